//! placeholder until thin-codegen writes the index
