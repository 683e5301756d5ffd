// Lowers the glibc and libstdc++ that xccl_rs's binaries need to torch's own floor
// (manylinux_2_28: glibc 2.28, libstdc++ of GCC 8), although they are built on a newer system
// (Debian 12: glibc 2.36, GCC 12). Linked in when XCCL_RS_PORTABLE=1 (scripts/build_wheels.sh;
// build.rs), with `-Wl,--wrap=X` for every `__wrap_X` defined here: the linker then sends every
// reference to X — from the C++ bridge, from Rust's std and from the crates — to `__wrap_X`.
// build.rs and scripts/build_wheels.sh read the list of wraps from this file's `__wrap_` names.
//
// A program built on a newer glibc binds each function to the newest version of it there
// (pthread_create@GLIBC_2.34, when glibc 2.34 merged libpthread into libc), and an older glibc
// refuses to load it. Three kinds of wrap, each sound:
//
// 1. The same function at an older version: glibc and libstdc++ keep every old version (the
//    objdump of Debian 12's libc.so.6 shows pthread_create@GLIBC_2.2.5 and @GLIBC_2.34 at one
//    address). `.symver` binds the call to the old one, which every glibc since has.
// 2. A function the old library lacks, written here from functions it has, as the newer one
//    does it (stat64 through __xstat64, as glibc's own headers did before 2.33;
//    pthread_cond_clockwait, glibc 2.30, looked up at run time and emulated on CLOCK_REALTIME
//    without it, as libstdc++ itself does on such systems; libstdc++'s few new entry points).
// 3. `__libc_single_threaded` (glibc 2.32), which libstdc++'s inline code reads to skip atomic
//    reference counts in a single-threaded process: here always 0, so they are always atomic.
//
// Compiled as C++17 (not 20) so that it references nothing newer itself.

#include <dlfcn.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <condition_variable>
#include <exception>
#include <mutex>
#include <new>
#include <sstream>
#include <string>

// Binds the undeclared-here name `alias` to `symbol@version`.
#define XCCL_RS_OLD(alias, symbol, version) __asm__(".symver " #alias "," #symbol "@" version)

extern "C" {

// --- 1. The same glibc functions at their first versions (x86_64: GLIBC_2.2.5). Before glibc
// 2.34 the pthread ones live in libpthread.so.0 and dlsym in libdl.so.2, which the binaries
// list as needed (build.rs).
int xccl_rs_old_pthread_create(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
XCCL_RS_OLD(xccl_rs_old_pthread_create, pthread_create, "GLIBC_2.2.5");
int __wrap_pthread_create(pthread_t* t, const pthread_attr_t* a, void* (*f)(void*), void* arg) {
  return xccl_rs_old_pthread_create(t, a, f, arg);
}

int xccl_rs_old_pthread_join(pthread_t, void**);
XCCL_RS_OLD(xccl_rs_old_pthread_join, pthread_join, "GLIBC_2.2.5");
int __wrap_pthread_join(pthread_t t, void** ret) { return xccl_rs_old_pthread_join(t, ret); }

int xccl_rs_old_pthread_detach(pthread_t);
XCCL_RS_OLD(xccl_rs_old_pthread_detach, pthread_detach, "GLIBC_2.2.5");
int __wrap_pthread_detach(pthread_t t) { return xccl_rs_old_pthread_detach(t); }

int xccl_rs_old_pthread_key_create(pthread_key_t*, void (*)(void*));
XCCL_RS_OLD(xccl_rs_old_pthread_key_create, pthread_key_create, "GLIBC_2.2.5");
int __wrap_pthread_key_create(pthread_key_t* k, void (*d)(void*)) { return xccl_rs_old_pthread_key_create(k, d); }

int xccl_rs_old_pthread_key_delete(pthread_key_t);
XCCL_RS_OLD(xccl_rs_old_pthread_key_delete, pthread_key_delete, "GLIBC_2.2.5");
int __wrap_pthread_key_delete(pthread_key_t k) { return xccl_rs_old_pthread_key_delete(k); }

int xccl_rs_old_pthread_setspecific(pthread_key_t, const void*);
XCCL_RS_OLD(xccl_rs_old_pthread_setspecific, pthread_setspecific, "GLIBC_2.2.5");
int __wrap_pthread_setspecific(pthread_key_t k, const void* v) { return xccl_rs_old_pthread_setspecific(k, v); }


int xccl_rs_old_pthread_attr_setstacksize(pthread_attr_t*, size_t);
XCCL_RS_OLD(xccl_rs_old_pthread_attr_setstacksize, pthread_attr_setstacksize, "GLIBC_2.2.5");
int __wrap_pthread_attr_setstacksize(pthread_attr_t* a, size_t s) { return xccl_rs_old_pthread_attr_setstacksize(a, s); }

int xccl_rs_old_pthread_attr_getstack(const pthread_attr_t*, void**, size_t*);
XCCL_RS_OLD(xccl_rs_old_pthread_attr_getstack, pthread_attr_getstack, "GLIBC_2.2.5");
int __wrap_pthread_attr_getstack(const pthread_attr_t* a, void** p, size_t* s) {
  return xccl_rs_old_pthread_attr_getstack(a, p, s);
}

int xccl_rs_old_pthread_attr_getguardsize(const pthread_attr_t*, size_t*);
XCCL_RS_OLD(xccl_rs_old_pthread_attr_getguardsize, pthread_attr_getguardsize, "GLIBC_2.2.5");
int __wrap_pthread_attr_getguardsize(const pthread_attr_t* a, size_t* s) {
  return xccl_rs_old_pthread_attr_getguardsize(a, s);
}

int xccl_rs_old_pthread_getattr_np(pthread_t, pthread_attr_t*);
XCCL_RS_OLD(xccl_rs_old_pthread_getattr_np, pthread_getattr_np, "GLIBC_2.2.5");
int __wrap_pthread_getattr_np(pthread_t t, pthread_attr_t* a) { return xccl_rs_old_pthread_getattr_np(t, a); }

int xccl_rs_old_pthread_setname_np(pthread_t, const char*);
XCCL_RS_OLD(xccl_rs_old_pthread_setname_np, pthread_setname_np, "GLIBC_2.12");
int __wrap_pthread_setname_np(pthread_t t, const char* n) { return xccl_rs_old_pthread_setname_np(t, n); }

void* xccl_rs_old_dlsym(void*, const char*);
XCCL_RS_OLD(xccl_rs_old_dlsym, dlsym, "GLIBC_2.2.5");
void* __wrap_dlsym(void* h, const char* name) { return xccl_rs_old_dlsym(h, name); }

// The libfabric transport opens libfabric.so.1 at run time (src/transport/ofi/shim.c).
void* xccl_rs_old_dlopen(const char*, int);
XCCL_RS_OLD(xccl_rs_old_dlopen, dlopen, "GLIBC_2.2.5");
void* __wrap_dlopen(const char* path, int flags) { return xccl_rs_old_dlopen(path, flags); }

int xccl_rs_old_dlclose(void*);
XCCL_RS_OLD(xccl_rs_old_dlclose, dlclose, "GLIBC_2.2.5");
int __wrap_dlclose(void* h) { return xccl_rs_old_dlclose(h); }

char* xccl_rs_old_dlerror(void);
XCCL_RS_OLD(xccl_rs_old_dlerror, dlerror, "GLIBC_2.2.5");
char* __wrap_dlerror(void) { return xccl_rs_old_dlerror(); }

// --- 2. Functions the old glibc lacks.

// glibc 2.33 made stat64/fstat64 functions; before, its headers turned them into these calls
// (_STAT_VER is 1 on x86_64).
int xccl_rs_old_xstat64(int, const char*, struct stat64*);
XCCL_RS_OLD(xccl_rs_old_xstat64, __xstat64, "GLIBC_2.2.5");
int __wrap_stat64(const char* path, struct stat64* buf) { return xccl_rs_old_xstat64(1, path, buf); }

int xccl_rs_old_fxstat64(int, int, struct stat64*);
XCCL_RS_OLD(xccl_rs_old_fxstat64, __fxstat64, "GLIBC_2.2.5");
int __wrap_fstat64(int fd, struct stat64* buf) { return xccl_rs_old_fxstat64(1, fd, buf); }

// gettid() is glibc 2.30; the system call is as old as Linux threads.
pid_t __wrap_gettid(void) { return static_cast<pid_t>(syscall(SYS_gettid)); }

// pthread_cond_clockwait (glibc 2.30) waits until a time on `clock` (steady, for
// std::condition_variable::wait_until on steady_clock). Without it, the deadline is carried
// over to CLOCK_REALTIME once, as libstdc++ does where the function is missing: a jump of the
// wall clock during the wait then moves the deadline.
typedef int (*xccl_rs_clockwait_fn)(pthread_cond_t*, pthread_mutex_t*, clockid_t, const struct timespec*);
static xccl_rs_clockwait_fn xccl_rs_clockwait(void) {
  static const xccl_rs_clockwait_fn fn =
      reinterpret_cast<xccl_rs_clockwait_fn>(xccl_rs_old_dlsym(RTLD_DEFAULT, "pthread_cond_clockwait"));
  return fn;
}
int __wrap_pthread_cond_clockwait(pthread_cond_t* cond, pthread_mutex_t* mutex, clockid_t clock,
                                  const struct timespec* abstime) {
  if (xccl_rs_clockwait_fn fn = xccl_rs_clockwait()) {
    return fn(cond, mutex, clock, abstime);
  }
  if (clock == CLOCK_REALTIME) {
    return pthread_cond_timedwait(cond, mutex, abstime);
  }
  struct timespec now_clock, now_real;
  clock_gettime(clock, &now_clock);
  clock_gettime(CLOCK_REALTIME, &now_real);
  long long left = (abstime->tv_sec - now_clock.tv_sec) * 1000000000LL + (abstime->tv_nsec - now_clock.tv_nsec);
  long long until = now_real.tv_sec * 1000000000LL + now_real.tv_nsec + (left > 0 ? left : 0);
  struct timespec real_deadline = {static_cast<time_t>(until / 1000000000LL), static_cast<long>(until % 1000000000LL)};
  return pthread_cond_timedwait(cond, mutex, &real_deadline);
}

// --- 3. libstdc++'s inline code asks whether the process is single-threaded (glibc 2.32).
char __wrap___libc_single_threaded = 0;

// --- libstdc++ (GLIBCXX_3.4.25 is GCC 8's; manylinux_2_28 allows up to 3.4.24, CXXABI_1.3.11).

// condition_variable::wait: GCC 12 gave it a new version (3.4.30, which lets a thread
// cancellation unwind through it); the 3.4.11 one is the same wait. xccl_rs cancels no thread.
void xccl_rs_old_cv_wait(std::condition_variable*, std::unique_lock<std::mutex>*);
XCCL_RS_OLD(xccl_rs_old_cv_wait, _ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE, "GLIBCXX_3.4.11");
void __wrap__ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE(std::condition_variable* cv,
                                                                       std::unique_lock<std::mutex>* lock) {
  xccl_rs_old_cv_wait(cv, lock);
}

// std::__throw_bad_array_new_length() (3.4.29): what the library's own does.
[[noreturn]] void __wrap__ZSt28__throw_bad_array_new_lengthv(void) { throw std::bad_array_new_length(); }

// exception_ptr::_M_addref / _M_release (CXXABI_1.3.13, GCC 11 made the copy inline): one
// reference more through the old copy constructor (a copy never destroyed), one fewer through
// the old destructor of a copy of the pointer (CXXABI_1.3.3, exported since GCC 4.4).
void xccl_rs_old_eptr_copy(void* self, const void* other);
XCCL_RS_OLD(xccl_rs_old_eptr_copy, _ZNSt15__exception_ptr13exception_ptrC1ERKS0_, "CXXABI_1.3.3");
void xccl_rs_old_eptr_destroy(void* self);
XCCL_RS_OLD(xccl_rs_old_eptr_destroy, _ZNSt15__exception_ptr13exception_ptrD1Ev, "CXXABI_1.3.3");
void __wrap__ZNSt15__exception_ptr13exception_ptr9_M_addrefEv(void* self) {
  void* never_destroyed;
  xccl_rs_old_eptr_copy(&never_destroyed, self);
}
void __wrap__ZNSt15__exception_ptr13exception_ptr10_M_releaseEv(void* self) {
  void* copy = *static_cast<void**>(self);
  xccl_rs_old_eptr_destroy(&copy);
}

#if _GLIBCXX_USE_CXX11_ABI
// std::ostringstream's default constructor (3.4.26): the one with its default mode, ios_base::out.
void __wrap__ZNSt7__cxx1119basic_ostringstreamIcSt11char_traitsIcESaIcEEC1Ev(std::ostringstream* self) {
  new (self) std::ostringstream(std::ios_base::out);
}

// std::stringbuf::str() && (3.4.29, C++20): the string, leaving the buffer empty. Returns the
// result's address, as the ABI does for a value returned through a hidden pointer.
std::string* __wrap__ZNOSt7__cxx1115basic_stringbufIcSt11char_traitsIcESaIcEE3strEv(std::string* result,
                                                                                     std::stringbuf* self) {
  new (result) std::string(self->str());
  const std::string empty;
  self->str(empty);
  return result;
}

// std::stringbuf::str() const & (3.4.29, C++20's ref-qualified overload), and the streams' that
// call it: the copy that the unqualified str() const (3.4.21) makes.
std::string* __wrap__ZNKRSt7__cxx1115basic_stringbufIcSt11char_traitsIcESaIcEE3strEv(std::string* result,
                                                                                      const std::stringbuf* self) {
  new (result) std::string(self->str());
  return result;
}
std::string* __wrap__ZNKRSt7__cxx1119basic_ostringstreamIcSt11char_traitsIcESaIcEE3strEv(
    std::string* result, const std::ostringstream* self) {
  new (result) std::string(self->str());
  return result;
}
std::string* __wrap__ZNKRSt7__cxx1118basic_stringstreamIcSt11char_traitsIcESaIcEE3strEv(
    std::string* result, const std::stringstream* self) {
  new (result) std::string(self->str());
  return result;
}
#endif

} // extern "C"
