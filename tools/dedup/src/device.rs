//! Access to a metadata device or image file, one 4 KiB block at a time.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::ondisk::{Block, BLOCK_SHIFT, BLOCK_SIZE};

/// Block-granular storage: a device, an image file or memory.
pub trait BlockDev {
    /// Whole 4 KiB blocks available (a trailing partial block is ignored,
    /// as the kernel's `bdev_nr_bytes() >> 12` does).
    fn nr_blocks(&self) -> u64;
    fn read_block(&self, nr: u64, buf: &mut Block) -> io::Result<()>;
    /// Read `buf.len() / 4096` consecutive blocks from `first`: one
    /// request where the storage allows, since per-block reads of a data
    /// device are slow (system calls, no readahead under emulation).
    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> io::Result<()> {
        for (i, b) in buf.chunks_exact_mut(BLOCK_SIZE).enumerate() {
            self.read_block(first + i as u64, b.try_into().unwrap())?;
        }
        Ok(())
    }
    fn write_block(&mut self, nr: u64, buf: &Block) -> io::Result<()>;
    /// Make every write so far durable.
    fn flush(&mut self) -> io::Result<()>;
}

/// A metadata image held in memory (tests, fuzzing).
#[derive(Clone, Debug, Default)]
pub struct MemDev {
    pub bytes: Vec<u8>,
}

impl MemDev {
    pub fn new(nr_blocks: u64) -> MemDev {
        MemDev {
            bytes: vec![0u8; nr_blocks as usize * BLOCK_SIZE],
        }
    }

    pub fn from_bytes(bytes: Vec<u8>) -> MemDev {
        MemDev { bytes }
    }

    pub fn block(&self, nr: u64) -> &Block {
        let o = nr as usize * BLOCK_SIZE;
        (&self.bytes[o..o + BLOCK_SIZE]).try_into().unwrap()
    }

    pub fn block_mut(&mut self, nr: u64) -> &mut Block {
        let o = nr as usize * BLOCK_SIZE;
        (&mut self.bytes[o..o + BLOCK_SIZE]).try_into().unwrap()
    }
}

/// Err unless blocks [first, first + n) are on a device of `have` blocks.
fn in_range(first: u64, n: usize, have: u64) -> io::Result<()> {
    match first.checked_add(n as u64) {
        Some(end) if end <= have => Ok(()),
        _ => Err(beyond_end(have.max(first))),
    }
}

fn beyond_end(nr: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("block {nr} is beyond the end of the device"),
    )
}

impl BlockDev for MemDev {
    fn nr_blocks(&self) -> u64 {
        (self.bytes.len() / BLOCK_SIZE) as u64
    }

    fn read_block(&self, nr: u64, buf: &mut Block) -> io::Result<()> {
        if nr >= self.nr_blocks() {
            return Err(beyond_end(nr));
        }
        buf.copy_from_slice(self.block(nr));
        Ok(())
    }

    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> io::Result<()> {
        in_range(first, buf.len() / BLOCK_SIZE, self.nr_blocks())?;
        let o = first as usize * BLOCK_SIZE;
        buf.copy_from_slice(&self.bytes[o..o + buf.len()]);
        Ok(())
    }

    fn write_block(&mut self, nr: u64, buf: &Block) -> io::Result<()> {
        if nr >= self.nr_blocks() {
            return Err(beyond_end(nr));
        }
        self.block_mut(nr).copy_from_slice(buf);
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A block device or a regular file.
#[derive(Debug)]
pub struct FileDev {
    file: File,
    path: PathBuf,
    bytes: u64,
    pub is_block_device: bool,
}

/// Why a device could not be opened, as one line.
#[derive(Debug)]
pub struct OpenError(pub String);

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl FileDev {
    /// Open `path` for reading (and writing if `write`). A block device is
    /// opened with O_EXCL: Linux then refuses it with EBUSY while it is
    /// mounted, held by device-mapper (an active dedup target) or opened
    /// exclusively by anyone else, so we never check or change metadata a
    /// running kernel target owns.
    pub fn open(path: &Path, write: bool) -> Result<FileDev, OpenError> {
        let p = path.display();
        let meta = std::fs::metadata(path).map_err(|e| OpenError(format!("{p}: {e}")))?;
        let ft = meta.file_type();
        let is_block_device = ft.is_block_device();
        if !is_block_device && !ft.is_file() {
            return Err(OpenError(format!(
                "{p}: not a block device or a regular file"
            )));
        }
        let mut opts = OpenOptions::new();
        opts.read(true).write(write);
        if is_block_device {
            opts.custom_flags(libc::O_EXCL);
        }
        let mut file = opts.open(path).map_err(|e| {
            if e.raw_os_error() == Some(libc::EBUSY) {
                OpenError(format!(
                    "{p}: device is busy (mounted, in use by device-mapper or opened exclusively); \
                     remove the dedup target first"
                ))
            } else {
                OpenError(format!("{p}: {e}"))
            }
        })?;
        let bytes = file
            .seek(SeekFrom::End(0))
            .map_err(|e| OpenError(format!("{p}: cannot find its size: {e}")))?;
        Ok(FileDev {
            file,
            path: path.to_path_buf(),
            bytes,
            is_block_device,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn size_bytes(&self) -> u64 {
        self.bytes
    }
}

impl BlockDev for FileDev {
    fn nr_blocks(&self) -> u64 {
        self.bytes >> BLOCK_SHIFT
    }

    fn read_block(&self, nr: u64, buf: &mut Block) -> io::Result<()> {
        if nr >= self.nr_blocks() {
            return Err(beyond_end(nr));
        }
        self.file.read_exact_at(&mut buf[..], nr << BLOCK_SHIFT)
    }

    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> io::Result<()> {
        in_range(first, buf.len() / BLOCK_SIZE, self.nr_blocks())?;
        self.file.read_exact_at(buf, first << BLOCK_SHIFT)
    }

    fn write_block(&mut self, nr: u64, buf: &Block) -> io::Result<()> {
        if nr >= self.nr_blocks() {
            return Err(beyond_end(nr));
        }
        self.file.write_all_at(&buf[..], nr << BLOCK_SHIFT)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.sync_all()
    }
}

/// Size in bytes of a file or block device, without opening it for writing.
pub fn size_of(path: &Path) -> io::Result<u64> {
    let mut f = File::open(path)?;
    f.seek(SeekFrom::End(0))
}
