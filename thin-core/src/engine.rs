//! The engine interface generated engines implement, and the weights view they read.
