//! The `.thin` v0 archive: header, page table, manifest; the streaming writer, the mmap reader and the verifier.
