//! Token sampling: greedy, temperature, top-k, top-p with a seeded RNG.
