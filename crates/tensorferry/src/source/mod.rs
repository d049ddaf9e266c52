//! Where bytes come from: local files today (any file system), with their size and
//! page-cache residency. Knows nothing of formats or devices.

pub mod local;

pub use local::LocalFile;
