//! CPU reference ops: plain f32 math, the oracle for every other backend.
