//! Element codecs: GGUF block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and F16/BF16/F32 to f32, and f32 to the storage types.
