//! The files in /dev/shm that ranks create and peers map: segments (segment.rs) and heaps
//! (heap.rs). Both are made the same way, so that no other user can read them and no peer can
//! make a rank open anything else: created with O_EXCL and mode 0600 under an unguessable name
//! `<prefix><pid>-<32 hex digits>`, and opened by a peer only under a name of that form, never
//! through a symbolic link.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use crate::error::{CommError, Result};

pub const SHM_DIR: &str = "/dev/shm";

/// Whether `name` is `<prefix><pid>-<32 hex digits>`, what [`create`] makes with `prefix`.
pub fn is_name(prefix: &str, name: &str) -> bool {
    let Some(rest) = name.strip_prefix(prefix) else { return false };
    let Some((pid, token)) = rest.split_once('-') else { return false };
    (1..=10).contains(&pid.len())
        && pid.bytes().all(|b| b.is_ascii_digit())
        && token.len() == 32
        && token.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Creates a new, empty file named `prefix` + this process's id + a random token; returns it,
/// its path and its name.
pub fn create(prefix: &str) -> Result<(File, PathBuf, String)> {
    let mut token = [0u8; 16];
    getrandom::fill(&mut token).map_err(|e| CommError::io(format!("getrandom failed: {e}")))?;
    let name = format!("{prefix}{}-{}", std::process::id(), token.iter().map(|b| format!("{b:02x}")).collect::<String>());
    let path = PathBuf::from(SHM_DIR).join(&name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| CommError::io(format!("cannot create {}: {e}", path.display())))?;
    Ok((file, path, name))
}

/// Opens a peer's file by `name`, which must be one that [`create`] makes with `prefix` (a
/// `what`, for the refusal's message); a symbolic link is not followed.
pub fn open(prefix: &str, name: &str, what: &str) -> Result<(File, PathBuf)> {
    if !is_name(prefix, name) {
        let shown: String = name.chars().take(80).collect();
        return Err(CommError::io(format!("refusing to map shared-memory {what} '{shown}': not a {what} name")));
    }
    let path = PathBuf::from(SHM_DIR).join(name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| CommError::io(format!("cannot open {}: {e}", path.display())))?;
    Ok((file, path))
}
