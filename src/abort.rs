//! How a group stops: its abort switch, and the notice of its first failure.
//!
//! `abort()` may come from any thread while the group's progress thread is blocked in an op:
//! raising the [`AbortSwitch`] makes that op fail at once, and every later op too. Waits notice
//! it where they sleep: the TCP exchange polls the switch's eventfd beside its sockets
//! (instant), shared-memory waits check it between naps of at most 100 ms.
//!
//! The [`FailureNotice`] keeps the first error that failed the group (a timeout, a dead peer,
//! a mismatch, an abort) and tells its listeners once, whether or not anyone waits for the op:
//! that is how torch's abort hooks fire and `get_error()` answers. The listeners run on a thread
//! of their own, like NCCL's watchdog: a hook may take seconds (torch's flight recorder writes
//! its trace to disk there), and the failed op's error must not wait for it: a job that recovers
//! (abort, reconfigure) would pay the dump on every failure. What must wait is the process's
//! exit, so that a script that ends on the error does not finalize Python under a dump that
//! still needs the interpreter: [`wait_for_listeners`] is what Python's exit calls. A run counts
//! from before the failed op's error is returned, so an exit right after the error cannot miss it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::error::{CommError, Result};

#[derive(Debug)]
pub struct AbortSwitch {
    raised: AtomicBool,
    reason: Mutex<String>,
    /// Readable once raised (a counter that is never read back); closed with the group
    /// ([`close`](Self::close)), since torch may keep a backend object alive after destroying
    /// its group.
    wake: Mutex<Option<OwnedFd>>,
}

impl AbortSwitch {
    pub fn new() -> Result<AbortSwitch> {
        // SAFETY: eventfd has no memory arguments; a non-negative result is a new descriptor
        // that nothing else owns, so OwnedFd may take it.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(CommError::io(format!("eventfd failed: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: see above: `fd` is a fresh descriptor owned by no one else.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(AbortSwitch { raised: AtomicBool::new(false), reason: Mutex::new(String::new()), wake: Mutex::new(Some(wake)) })
    }

    /// Raises the switch (the first reason is kept); never blocks.
    pub fn raise(&self, reason: &str) {
        {
            let mut r = self.reason.lock();
            if r.is_empty() {
                *r = reason.to_string();
            }
        }
        self.raised.store(true, Ordering::Release);
        if let Some(wake) = self.wake.lock().as_ref() {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to our own eventfd, which the lock keeps
            // open. Non-blocking: if the counter were full the write fails harmlessly (it is
            // readable already).
            unsafe { libc::write(wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Closes the descriptor: the group is gone and no op will wait any more.
    pub fn close(&self) {
        self.wake.lock().take();
    }

    pub fn is_raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    /// A descriptor that polls readable once the switch is raised (None once closed). Ops
    /// poll it while they hold the group's worker lock, and [`close`](Self::close) runs under
    /// that lock too (comm.rs `Worker::close`), so the number stays valid while it is polled.
    pub fn fd(&self) -> Option<RawFd> {
        self.wake.lock().as_ref().map(|w| w.as_raw_fd())
    }

    /// The error of an op that the switch stopped; `what` says which ("allreduce #3 on rank 1").
    pub fn error(&self, what: &str) -> CommError {
        CommError::aborted(format!("aborted: {}", self.reason.lock())).within(what)
    }
}

/// Called once, with the group's first failure.
pub type FailureListener = Arc<dyn Fn(&CommError) + Send + Sync>;

#[derive(Default)]
pub struct FailureNotice {
    first: Mutex<Option<CommError>>,
    listeners: Mutex<Vec<FailureListener>>,
    /// The listeners' run, once the group has failed (until someone waited for it to end).
    running: Mutex<Option<ListenersRunning>>,
}

impl FailureNotice {
    /// The error that failed the group, if it has failed.
    pub fn first(&self) -> Option<CommError> {
        self.first.lock().clone()
    }

    /// `listener` hears of the group's first failure (not of one that happened already).
    pub fn listen(&self, listener: FailureListener) {
        self.listeners.lock().push(listener);
    }

    /// Records `e` if it is the first failure, and then tells the listeners on a thread of
    /// their own (outside the locks: a listener may ask for [`first`](Self::first)); false when
    /// the group had failed already or there is no listener.
    pub fn record(&self, e: &CommError) -> bool {
        {
            let mut first = self.first.lock();
            if first.is_some() {
                return false;
            }
            *first = Some(e.clone());
        }
        let listeners = self.listeners.lock().clone();
        if listeners.is_empty() {
            return false;
        }
        let e = e.clone();
        let (done, finished) = mpsc::channel::<()>();
        let counted = ListenerRun::start();
        let tell = move || {
            let _ends = (done, counted); // dropped when the thread ends, however it ends
            for listener in listeners {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| listener(&e)));
            }
        };
        let started = std::thread::Builder::new().name("xccl_rs-hooks".into()).spawn(tell).is_ok();
        if started {
            *self.running.lock() = Some(ListenersRunning(finished));
        }
        started
    }

    /// Waits until the listeners told of the failure have returned, or `bound` has passed; true
    /// when they returned (or were never told). A group's shutdown waits here: torch drops a
    /// group's hooks (its flight recorder's) right after shutting the group down, so hooks still
    /// running then would find nothing left to dump.
    pub fn wait_for_listeners(&self, bound: Duration) -> bool {
        let mut running = self.running.lock();
        let returned = running.as_ref().is_none_or(|r| r.wait(bound));
        if returned {
            *running = None;
        }
        returned
    }
}

/// Listener runs in progress in this process (every group's).
static RUNNING: Mutex<usize> = Mutex::new(0);
static RUN_ENDED: Condvar = Condvar::new();

/// One listener run, counted from its start to its end.
struct ListenerRun;

impl ListenerRun {
    fn start() -> ListenerRun {
        *RUNNING.lock() += 1;
        ListenerRun
    }
}

impl Drop for ListenerRun {
    fn drop(&mut self) {
        *RUNNING.lock() -= 1;
        RUN_ENDED.notify_all();
    }
}

/// Waits until no group's failure listeners are running in this process, or `bound` has
/// passed; true when none are.
pub fn wait_for_listeners(bound: Duration) -> bool {
    let deadline = std::time::Instant::now().checked_add(bound);
    let mut running = RUNNING.lock();
    while *running > 0 {
        match deadline {
            Some(d) => {
                if RUN_ENDED.wait_until(&mut running, d).timed_out() {
                    return *running == 0;
                }
            }
            None => RUN_ENDED.wait(&mut running),
        }
    }
    true
}

/// The failure listeners, running on their thread.
pub struct ListenersRunning(mpsc::Receiver<()>);

impl ListenersRunning {
    /// Waits until every listener has returned, or `bound` has passed; true when they returned.
    pub fn wait(&self, bound: Duration) -> bool {
        !matches!(self.0.recv_timeout(bound), Err(mpsc::RecvTimeoutError::Timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn raised_switch_polls_readable_and_keeps_the_first_reason() {
        let s = AbortSwitch::new().unwrap();
        let mut fds = [libc::pollfd { fd: s.fd().unwrap(), events: libc::POLLIN, revents: 0 }];
        // SAFETY: `fds` is a live array of one pollfd.
        assert_eq!(unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) }, 0, "not readable before");
        s.raise("abort() was called");
        s.raise("a second reason");
        // SAFETY: as above.
        assert_eq!(unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) }, 1, "readable after");
        assert!(s.is_raised());
        assert_eq!(s.error("barrier #0 on rank 0").to_string(), "xccl_rs: barrier #0 on rank 0: aborted: abort() was called");
    }

    #[test]
    fn the_notice_keeps_the_first_failure_and_tells_each_listener_once() {
        let notice = FailureNotice::default();
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        notice.listen(Arc::new(move |e: &CommError| h.lock().push(e.message.clone())));
        assert_eq!(notice.first(), None);
        assert!(notice.record(&CommError::new(ErrorKind::Timeout, "first")), "a listener thread");
        assert!(notice.wait_for_listeners(Duration::from_secs(10)));
        assert!(!notice.record(&CommError::new(ErrorKind::PeerFailure, "second")));
        assert_eq!(notice.first().map(|e| e.kind), Some(ErrorKind::Timeout));
        assert_eq!(*heard.lock(), vec!["first".to_string()]);
    }

    #[test]
    fn waiting_for_the_listeners_is_bounded() {
        let notice = FailureNotice::default();
        let release = Arc::new(AtomicBool::new(false));
        let r = release.clone();
        notice.listen(Arc::new(move |_: &CommError| {
            while !r.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
        }));
        assert!(notice.record(&CommError::new(ErrorKind::Timeout, "stuck hook")), "a listener thread");
        let t0 = std::time::Instant::now();
        assert!(!notice.wait_for_listeners(Duration::from_millis(100)), "a listener that has not returned is still running");
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(!wait_for_listeners(Duration::from_millis(50)), "the process-wide count sees it too");
        release.store(true, Ordering::Release);
        assert!(notice.wait_for_listeners(Duration::from_secs(10)), "it returned once released");
        assert!(wait_for_listeners(Duration::from_secs(10)), "and the count drops when its thread ends");
    }
}
