//! Where bytes come from: local files (any file system), with their size and page-cache
//! residency, and object stores (S3, GCS, Azure, HTTP) by ranged requests. Knows nothing
//! of formats or devices.

pub mod local;
pub mod object;

pub use local::LocalFile;
pub use object::{is_url, Location, ObjectFile, ObjectOptions};
