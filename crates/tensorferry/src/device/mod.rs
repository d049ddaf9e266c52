//! Memory the bytes land in: host buffers and the staging pool today; CUDA devices are
//! loaded at run time (see [`Device`]).

pub mod cuda;
pub mod host;
pub mod staging;

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// Where tensors are loaded to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Parses `cpu`, `cuda`, `cuda:N` or a bare ordinal `N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        if s == "cuda" {
            return Ok(Device::Cuda(0));
        }
        let ordinal = s.strip_prefix("cuda:").unwrap_or(s);
        ordinal.parse().map(Device::Cuda).map_err(|_| {
            Error::InvalidArgument(format!("device {s:?}: expected cpu, cuda or cuda:N"))
        })
    }
}
