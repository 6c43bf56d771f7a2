//! dm-dedup userspace tools: the on-disk format, the journal replay, the
//! checker, the repair, the writer used by format, restore and repair, the
//! dump format, the estimator and the status parser. The `dedup` binary is
//! a thin command line over these.

pub mod check;
pub mod crc32c;
pub mod device;
pub mod dump;
pub mod estimate;
pub mod fingerprint;
pub mod fuzzing;
pub mod journal;
pub mod ondisk;
pub mod repair;
pub mod salvage;
pub mod stats;
pub mod util;
pub mod writer;
