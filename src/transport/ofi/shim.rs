//! The Rust side of shim.c: its functions, the loaded library, and an [`Endpoint`] that owns
//! what the shim opened. Nothing here knows of ranks or messages.

use std::ffi::{CStr, CString, c_char, c_int, c_long, c_void};

use once_cell::sync::OnceCell;

/// The library's file name: its ABI has kept this soname from 1.0 through 2.x.
pub const LIBRARY: &str = "libfabric.so.1";
/// The oldest libfabric accepted: the API version of the vendored headers (include/rdma/), which
/// the shim asks for and the transport is tested with.
pub const MIN_VERSION: (u32, u32) = (1, 17);
/// libfabric's FI_EAGAIN (fi_errno.h): the provider wants progress before it takes more work.
pub const FI_EAGAIN: i64 = 11;
/// FI_ETRUNC: a message longer than the buffer posted for it.
pub const FI_ETRUNC: i32 = 265;
/// FI_ECANCELED: an operation that fi_cancel stopped.
pub const FI_ECANCELED: i32 = 125;
/// FI_ENODATA: no provider matches.
pub const FI_ENODATA: c_int = 61;
/// FI_EINVAL: an invalid argument.
pub const FI_EINVAL: c_int = 22;
/// The shim's own code (shim.c XOFI_EBADTAG): a tag outside the endpoint's mask, not posted.
const XOFI_EBADTAG: c_long = 100000;

/// libfabric's opaque `struct fi_info`.
#[repr(C)]
pub struct FiInfo {
    _private: [u8; 0],
}

#[repr(C)]
struct RawEndpoint {
    _private: [u8; 0],
}

/// One completion (shim.c's `struct xofi_completion`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Completion {
    pub context: *mut c_void,
    pub len: u64,
    pub tag: u64,
    pub olen: u64,
    /// 0, or the positive libfabric error code of a failed operation.
    pub err: i32,
    pub prov_errno: i32,
}

impl Default for Completion {
    fn default() -> Self {
        Completion { context: std::ptr::null_mut(), len: 0, tag: 0, olen: 0, err: 0, prov_errno: 0 }
    }
}

unsafe extern "C" {
    fn xofi_load(path: *const c_char, err: *mut c_char, err_len: usize) -> c_int;
    fn xofi_version() -> u32;
    fn xofi_strerror(code: c_int) -> *const c_char;
    fn xofi_getinfo(source: *const c_char, out: *mut *mut FiInfo) -> c_int;
    fn xofi_freeinfo(info: *mut FiInfo);
    fn xofi_info_next(info: *const FiInfo) -> *const FiInfo;
    fn xofi_info_provider(info: *const FiInfo) -> *const c_char;
    fn xofi_info_domain(info: *const FiInfo) -> *const c_char;
    fn xofi_info_max_msg_size(info: *const FiInfo) -> usize;
    fn xofi_info_rx_size(info: *const FiInfo) -> usize;
    fn xofi_info_mem_tag_format(info: *const FiInfo) -> u64;
    fn xofi_open(info: *const FiInfo, want_fd: c_int, err: *mut c_char, err_len: usize) -> *mut RawEndpoint;
    fn xofi_close(ep: *mut RawEndpoint);
    fn xofi_wait_fd(ep: *const RawEndpoint) -> c_int;
    fn xofi_manual_progress(ep: *const RawEndpoint) -> c_int;
    fn xofi_name(ep: *mut RawEndpoint, buf: *mut c_void, len: *mut usize) -> c_int;
    fn xofi_set_tag_mask(ep: *mut RawEndpoint, mask: u64);
    fn xofi_av_insert(ep: *mut RawEndpoint, addr: *const c_void, out: *mut u64) -> c_int;
    fn xofi_tsend(ep: *mut RawEndpoint, buf: *const c_void, len: usize, dest: u64, tag: u64, context: *mut c_void) -> c_long;
    fn xofi_trecv(ep: *mut RawEndpoint, buf: *mut c_void, len: usize, src: u64, tag: u64, ignore: u64, context: *mut c_void) -> c_long;
    fn xofi_cancel(ep: *mut RawEndpoint, context: *mut c_void) -> c_int;
    fn xofi_poll(ep: *mut RawEndpoint, out: *mut Completion, max: c_int) -> c_int;
    fn xofi_trywait(ep: *mut RawEndpoint) -> c_int;
}

/// Proof that libfabric is loaded (and new enough): the shim's other calls need it.
#[derive(Clone, Copy)]
pub struct Library {
    /// The loaded library's version.
    pub version: (u32, u32),
}

static LOADED: OnceCell<std::result::Result<Library, String>> = OnceCell::new();

/// Loads libfabric.so.1 once per process; the error says what is missing and how to get it.
pub fn load() -> std::result::Result<Library, String> {
    LOADED
        .get_or_init(|| {
            let path = CString::new(LIBRARY).expect("no NUL in the library name");
            let mut err = [0 as c_char; 512];
            // SAFETY: `path` is a NUL-terminated string and `err` a writable buffer of the size
            // passed; OnceCell runs this once, so the shim's global state is never raced.
            let rc = unsafe { xofi_load(path.as_ptr(), err.as_mut_ptr(), err.len()) };
            if rc != 0 {
                // SAFETY: the shim wrote a NUL-terminated message within `err` (snprintf).
                let why = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
                return Err(format!(
                    "XCCL_RS_TRANSPORT=ofi needs libfabric ({LIBRARY} not found: {why}); apt-get install libfabric1"
                ));
            }
            // SAFETY: the library is loaded (rc 0), so the shim's function pointers are set.
            let v = unsafe { xofi_version() };
            let version = (v >> 16, v & 0xffff);
            if version < MIN_VERSION {
                return Err(format!(
                    "XCCL_RS_TRANSPORT=ofi needs libfabric {}.{} or newer; this machine's {LIBRARY} is {}.{}",
                    MIN_VERSION.0, MIN_VERSION.1, version.0, version.1
                ));
            }
            Ok(Library { version })
        })
        .clone()
}

impl Library {
    /// libfabric's words for error `code` (either sign).
    pub fn strerror(&self, code: i64) -> String {
        // SAFETY: loaded (self exists); fi_strerror returns a static NUL-terminated string.
        unsafe { CStr::from_ptr(xofi_strerror(code.unsigned_abs().min(i32::MAX as u64) as c_int)) }.to_string_lossy().into_owned()
    }

    /// The providers that offer reliable tagged messages (shim.c `xofi_getinfo`), each with
    /// its name and domain, in libfabric's order; with `source`, those whose endpoint can use
    /// that address (or host name) as its own.
    pub fn providers(&self, source: Option<&str>) -> std::result::Result<InfoList, i32> {
        let source = match source.map(CString::new) {
            Some(Ok(s)) => Some(s),
            Some(Err(_)) => return Err(-FI_EINVAL),
            None => None,
        };
        let mut head = std::ptr::null_mut();
        // SAFETY: loaded; `source` is NULL or a NUL-terminated string alive for the call; `head`
        // is a valid out-pointer.
        let rc = unsafe { xofi_getinfo(source.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()), &mut head) };
        if rc != 0 {
            return Err(rc);
        }
        Ok(InfoList { head, _lib: *self })
    }
}

/// A list that fi_getinfo returned; freed on drop.
pub struct InfoList {
    head: *mut FiInfo,
    _lib: Library,
}

/// One entry of an [`InfoList`].
pub struct Info<'a> {
    ptr: *const FiInfo,
    pub provider: String,
    pub domain: String,
    pub max_msg_size: usize,
    /// How many receives the endpoint holds posted at once.
    pub rx_size: usize,
    /// The provider's tag format: its highest set bit is the highest tag bit it matches.
    pub mem_tag_format: u64,
    _list: std::marker::PhantomData<&'a InfoList>,
}

impl InfoList {
    pub fn entries(&self) -> Vec<Info<'_>> {
        let mut out = Vec::new();
        let mut p = self.head as *const FiInfo;
        while !p.is_null() {
            // SAFETY: `p` is an element of the list fi_getinfo returned, alive until drop; the
            // accessors return strings owned by it (copied here) or plain numbers.
            let (provider, domain, max_msg_size, rx_size, mem_tag_format) = unsafe {
                (
                    CStr::from_ptr(xofi_info_provider(p)).to_string_lossy().into_owned(),
                    CStr::from_ptr(xofi_info_domain(p)).to_string_lossy().into_owned(),
                    xofi_info_max_msg_size(p),
                    xofi_info_rx_size(p),
                    xofi_info_mem_tag_format(p),
                )
            };
            out.push(Info { ptr: p, provider, domain, max_msg_size, rx_size, mem_tag_format, _list: std::marker::PhantomData });
            // SAFETY: as above.
            p = unsafe { xofi_info_next(p) };
        }
        out
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.head.is_null() {
            // SAFETY: `head` came from fi_getinfo and is freed once.
            unsafe { xofi_freeinfo(self.head) };
        }
    }
}

/// An open endpoint with its completion queue and address vector (shim.c `xofi_ep`).
pub struct Endpoint {
    raw: *mut RawEndpoint,
    lib: Library,
    /// The bits a tag may have ([`set_tag_mask`](Self::set_tag_mask)), for errors.
    tag_mask: u64,
}

// SAFETY: the endpoint is opened with FI_THREAD_DOMAIN and used by one thread at a time (it
// moves with the transport to the progress thread; `&mut self` serializes every call).
unsafe impl Send for Endpoint {}

/// What a post returned: accepted, or the provider is busy (progress and retry).
#[derive(Debug, PartialEq, Eq)]
pub enum Posted {
    Yes,
    Busy,
}

impl Endpoint {
    /// Opens an endpoint of `info`, whose completion queue has a file descriptor to sleep on
    /// where the provider offers one and `want_fd` asks for it.
    pub fn open(lib: &Library, info: &Info<'_>, want_fd: bool) -> std::result::Result<Endpoint, String> {
        let mut err = [0 as c_char; 512];
        // SAFETY: `info.ptr` is alive (borrowed from its list); `err` is writable of its length.
        let raw = unsafe { xofi_open(info.ptr, want_fd as c_int, err.as_mut_ptr(), err.len()) };
        if raw.is_null() {
            // SAFETY: the shim wrote a NUL-terminated message into `err`.
            return Err(unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned());
        }
        Ok(Endpoint { raw, lib: *lib, tag_mask: u64::MAX })
    }

    pub fn lib(&self) -> &Library {
        &self.lib
    }

    /// The completion queue's file descriptor to poll, if the provider has one.
    pub fn wait_fd(&self) -> Option<i32> {
        // SAFETY: `raw` is open until drop.
        let fd = unsafe { xofi_wait_fd(self.raw) };
        (fd >= 0).then_some(fd)
    }

    /// This endpoint's address, as peers insert it.
    pub fn name(&mut self) -> std::result::Result<Vec<u8>, String> {
        let mut buf = vec![0u8; 1024];
        let mut len = buf.len();
        // SAFETY: `buf` is writable for `len` bytes; the shim writes at most that much.
        let rc = unsafe { xofi_name(self.raw, buf.as_mut_ptr().cast(), &mut len) };
        if rc != 0 {
            return Err(format!("fi_getname failed: {}", self.lib.strerror(rc as i64)));
        }
        buf.truncate(len);
        Ok(buf)
    }

    /// Inserts a peer's address; its handle for posts.
    pub fn insert(&mut self, addr: &[u8], expected_len: usize) -> std::result::Result<u64, String> {
        // The provider reads as many bytes as its own addresses have.
        if addr.len() != expected_len {
            return Err(format!("an address of {} bytes, this provider's have {expected_len}", addr.len()));
        }
        let mut out = 0u64;
        // SAFETY: `addr` holds a whole address of this provider's length (checked above).
        let rc = unsafe { xofi_av_insert(self.raw, addr.as_ptr().cast(), &mut out) };
        if rc != 0 {
            return Err(format!("fi_av_insert failed: {}", self.lib.strerror(rc as i64)));
        }
        Ok(out)
    }

    /// Limits every later post to tags within `mask` (the layout's: tags.rs); a post outside
    /// it fails without reaching the provider.
    pub fn set_tag_mask(&mut self, mask: u64) {
        // SAFETY: `raw` is open until drop; the shim only stores the mask.
        unsafe { xofi_set_tag_mask(self.raw, mask) };
        self.tag_mask = mask;
    }

    fn posted(&self, rc: c_long, what: &str, tag: u64) -> std::result::Result<Posted, String> {
        match rc {
            0 => Ok(Posted::Yes),
            r if r == -FI_EAGAIN => Ok(Posted::Busy),
            r if r == -XOFI_EBADTAG => Err(format!("{what}: tag {tag:#x} has bits outside the endpoint's tag mask {:#x} (not posted)", self.tag_mask)),
            r => Err(format!("{what} failed: {}", self.lib.strerror(r))),
        }
    }

    /// Posts a tagged send of `len` bytes at `buf`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay readable, and `context` (64 bytes) alive and unmoved, until the
    /// operation's completion has been read (or the endpoint closed).
    pub unsafe fn tsend(&mut self, buf: *const u8, len: usize, dest: u64, tag: u64, context: *mut c_void) -> std::result::Result<Posted, String> {
        // SAFETY: the caller's contract.
        let rc = unsafe { xofi_tsend(self.raw, buf.cast(), len, dest, tag, context) };
        self.posted(rc, "fi_tsend", tag)
    }

    /// Posts a tagged receive into `len` bytes at `buf`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay writable and otherwise unused, and `context` alive and unmoved,
    /// until the operation's completion has been read (or the endpoint closed).
    pub unsafe fn trecv(&mut self, buf: *mut u8, len: usize, src: u64, tag: u64, context: *mut c_void) -> std::result::Result<Posted, String> {
        // SAFETY: the caller's contract.
        let rc = unsafe { xofi_trecv(self.raw, buf.cast(), len, src, tag, 0, context) };
        self.posted(rc, "fi_trecv", tag)
    }

    /// Asks the provider to stop the operation posted with `context` (best effort: it then
    /// completes with FI_ECANCELED, or normally if it was too late).
    ///
    /// # Safety
    /// `context` must be that of an operation posted on this endpoint and not yet completed.
    pub unsafe fn cancel(&mut self, context: *mut c_void) {
        // SAFETY: the caller's contract; fi_cancel only looks the context up.
        let _ = unsafe { xofi_cancel(self.raw, context) };
    }

    /// Reads completions into `out` (driving the provider's progress): how many.
    pub fn poll(&mut self, out: &mut [Completion]) -> std::result::Result<usize, String> {
        // SAFETY: `out` is writable for `out.len()` entries (at most 32 are written).
        let n = unsafe { xofi_poll(self.raw, out.as_mut_ptr(), out.len().min(32) as c_int) };
        if n < 0 {
            return Err(format!("fi_cq_read failed: {}", self.lib.strerror(n as i64)));
        }
        Ok(n as usize)
    }

    /// Gives up an endpoint whose posts did not come back after they were cancelled.
    /// libfabric 1.17's rxm crashes (SIGSEGV) closing an endpoint with posts still in flight,
    /// as after a link cut. A provider with manual progress never touches a post's buffer
    /// again once nobody reads its queue (a later group opens a fabric and domain of its own),
    /// so its endpoint is left open and unused until the process ends, keeping its memory and
    /// sockets. One that progresses on its own could still write into the buffers: it is
    /// closed, which ends its posts.
    pub fn abandon(self) {
        // SAFETY: `raw` is open.
        if unsafe { xofi_manual_progress(self.raw) } != 0 {
            std::mem::forget(self);
        }
    }

    /// Whether the caller may now sleep on [`wait_fd`](Self::wait_fd) (fi_trywait).
    pub fn may_sleep(&mut self) -> bool {
        // SAFETY: `raw` is open.
        unsafe { xofi_trywait(self.raw) == 0 }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: opened by xofi_open, closed once; no operation is in flight that Rust still
        // tracks (the transport drains or gives up on them before it drops the endpoint).
        unsafe { xofi_close(self.raw) };
    }
}
