//! The CPU engine's threads: a persistent pool that runs each op as one parallel region, the way
//! ggml-cpu's threadpool does, instead of a rayon fork/join per matvec.
//!
//! A region is `tasks` independent calls `f(task)`. The thread that asks for it publishes the job,
//! takes tasks itself and waits for the last one; the workers claim tasks from one atomic word.
//! Between regions the workers spin on that word for [`SPIN`] (decode's ops come microseconds
//! apart, so no OS wakeup is paid inside a token), then park until the next region wakes them.
//!
//! Policies:
//! - A panic inside a task is caught where it happens; the region still completes (every task is
//!   accounted for, so nothing waits forever and no borrowed data outlives the call), then the
//!   first panic resumes on the calling thread, as rayon propagates it.
//! - One region at a time: a call made while another thread holds the pool, or from inside a task,
//!   runs its tasks on the calling thread (same results, no deadlock).
//! - How a region is split never changes a result: each task computes its own outputs whole.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, TryLockError};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking: longer than the serial gaps between the ops of a
/// decode step (norms, RoPE, sampling: microseconds), short enough that a worker sharing its core
/// with other processes sleeps often (a thread that never sleeps loses the scheduler's wakeup
/// preference, measured 2x slower decode at load 5 with a 1 ms spin).
const SPIN: Duration = Duration::from_micros(50);

/// Most threads `--threads` accepts (ggml's `GGML_MAX_N_THREADS`).
pub const MAX_THREADS: usize = 512;

/// Most tasks in one region (the claim word holds the count in 16 bits).
pub const MAX_TASKS: usize = u16::MAX as usize;

/// A thread count that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ThreadsError {
    #[error("0 threads: at least one thread runs the engine")]
    Zero,
    #[error("{asked} threads is more than the {max} a pool may have")]
    TooMany { asked: usize, max: usize },
    #[error("could not start CPU worker thread {index}: {message}")]
    Spawn { index: usize, message: String },
}

/// The job of the current region; lives on the stack of the thread that runs the region.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
}

/// What the workers and the region's caller share.
struct Shared {
    /// `generation << 32 | next << 16 | tasks`: the next unclaimed task of the current region and
    /// its task count. A claim is a compare-exchange of the whole word, so a worker late from an
    /// earlier region (older generation) can never take a task of this one.
    claim: AtomicU64,
    /// The current region's job, valid while a claim of its generation is outstanding.
    job: AtomicPtr<Job<'static>>,
    /// Tasks of the current region that have finished (or panicked).
    done: AtomicUsize,
    /// The first panic of the current region.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Per worker: parked, waiting for [`Pool::wake`].
    parked: Vec<AtomicBool>,
    shutdown: AtomicBool,
}

const fn next_of(c: u64) -> usize {
    ((c >> 16) & 0xffff) as usize
}

const fn tasks_of(c: u64) -> usize {
    (c & 0xffff) as usize
}

impl Shared {
    /// Claims and runs tasks of the current region until none is left.
    fn work(&self) {
        let mut c = self.claim.load(Acquire);
        while next_of(c) < tasks_of(c) {
            match self.claim.compare_exchange_weak(c, c + (1 << 16), AcqRel, Acquire) {
                Ok(_) => {
                    // SAFETY: our claim is of the current generation, so its caller is inside
                    // `Pool::region`, which keeps `job` alive until every claimed task is done.
                    let job = unsafe { &*self.job.load(Acquire) };
                    if let Err(p) = catch_unwind(AssertUnwindSafe(|| (job.f)(next_of(c)))) {
                        self.panic.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(p);
                    }
                    self.done.fetch_add(1, Release);
                    c = self.claim.load(Acquire);
                }
                Err(now) => c = now,
            }
        }
    }

    fn has_work(&self) -> bool {
        let c = self.claim.load(SeqCst);
        next_of(c) < tasks_of(c)
    }

    /// A worker's life: work, spin for the next region, park when none comes.
    fn worker(&self, index: usize) {
        loop {
            self.work();
            let idle = Instant::now();
            let mut spins = 0u32;
            while !self.has_work() && !self.shutdown.load(Relaxed) {
                std::hint::spin_loop();
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(256) && idle.elapsed() > SPIN {
                    // Parked flag first, then one more look: `wake` stores the claim before it
                    // reads the flag, so either we see the work or it sees us (both SeqCst).
                    self.parked[index].store(true, SeqCst);
                    if !self.has_work() && !self.shutdown.load(SeqCst) {
                        std::thread::park();
                    }
                    self.parked[index].store(false, SeqCst);
                }
            }
            if self.shutdown.load(Acquire) {
                return;
            }
        }
    }
}

/// A persistent pool of `threads - 1` workers plus the thread that calls [`Pool::region`].
struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    workers: Vec<(Thread, JoinHandle<()>)>,
    generation: u64,
}

impl Pool {
    fn new(threads: usize) -> Result<Pool, ThreadsError> {
        check_threads(threads)?;
        let shared = Arc::new(Shared {
            claim: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            parked: (1..threads).map(|_| AtomicBool::new(false)).collect(),
            shutdown: AtomicBool::new(false),
        });
        let mut pool = Pool { shared, threads, workers: Vec::new(), generation: 0 };
        for index in 0..threads - 1 {
            let s = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(format!("thin-cpu-{}", index + 1))
                .spawn(move || s.worker(index))
                .map_err(|e| ThreadsError::Spawn { index: index + 1, message: e.to_string() })?;
            pool.workers.push((handle.thread().clone(), handle));
        }
        Ok(pool)
    }

    /// Unparks the workers that parked; called after the claim word is stored.
    fn wake(&self) {
        for (flag, (thread, _)) in self.shared.parked.iter().zip(&self.workers) {
            if flag.swap(false, SeqCst) {
                thread.unpark();
            }
        }
    }

    /// Runs `f(0..tasks)` on the pool and returns when all have finished.
    fn region(&mut self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(tasks <= MAX_TASKS, "{tasks} tasks in one region (at most {MAX_TASKS})");
        let s = &*self.shared;
        let job = Job { f };
        s.done.store(0, Relaxed);
        // The lifetime is erased for the shared slot; `job` outlives every use of it (below).
        s.job.store(&job as *const Job<'_> as *mut Job<'static>, Release);
        self.generation = (self.generation + 1) & 0xffff_ffff;
        s.claim.store(self.generation << 32 | tasks as u64, SeqCst);
        self.wake();
        s.work();
        // Tasks a worker claimed may still be running: wait for them (spinning, then yielding the
        // core, which the worker may need when the machine is oversubscribed).
        let mut spins = 0u32;
        while s.done.load(Acquire) < tasks {
            spins = spins.saturating_add(1);
            if spins < 4096 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        s.job.store(std::ptr::null_mut(), Relaxed);
        if let Some(p) = s.panic.lock().unwrap_or_else(PoisonError::into_inner).take() {
            resume_unwind(p);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        for (thread, _) in &self.workers {
            thread.unpark();
        }
        for (_, handle) in self.workers.drain(..) {
            // A worker catches every task's panic, so it returns normally.
            let _ = handle.join();
        }
    }
}

/// The process's pool: made at the first region with [`default_threads`], or by [`set_threads`].
static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// `threads` if a pool can have that many (1 to [`MAX_THREADS`]).
pub fn check_threads(threads: usize) -> Result<usize, ThreadsError> {
    match threads {
        0 => Err(ThreadsError::Zero),
        n if n > MAX_THREADS => Err(ThreadsError::TooMany { asked: n, max: MAX_THREADS }),
        n => Ok(n),
    }
}

/// Physical cores this process may run on: the CPUs it is allowed (affinity, cgroup quota) divided
/// by the hardware threads per core (SMT siblings share a core's load ports, and a spinning
/// sibling only takes cycles from the working one). ggml-cpu's default likewise.
/// Read once per process.
pub fn default_threads() -> usize {
    static DEFAULT: OnceLock<usize> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
        (allowed / smt_per_core()).max(1)
    })
}

/// Hardware threads per core, from Linux's topology files (1 where they cannot be read).
fn smt_per_core() -> usize {
    let siblings = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").unwrap_or_default();
    // "0", "0,64" or "0-1": count the CPUs the list names.
    siblings
        .trim()
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('-') {
            Some((a, b)) => match (a.parse::<usize>(), b.parse::<usize>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 1,
            },
            None => 1,
        })
        .sum::<usize>()
        .max(1)
}

/// Sets the CPU engine's thread count (the calling thread and `threads - 1` workers), replacing
/// the pool; waits for a region in progress on another thread to finish first.
pub fn set_threads(threads: usize) -> Result<(), ThreadsError> {
    check_threads(threads)?;
    let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    if pool.as_ref().is_some_and(|p| p.threads == threads) {
        return Ok(());
    }
    *pool = None; // the old workers are joined before the new ones start
    *pool = Some(Pool::new(threads)?);
    CONFIGURED.store(threads, Relaxed);
    Ok(())
}

/// The thread count [`set_threads`] set (0: not set, [`default_threads`] applies).
static CONFIGURED: AtomicUsize = AtomicUsize::new(0);

/// The CPU engine's thread count: as [`set_threads`] set it, else [`default_threads`].
pub fn threads() -> usize {
    match CONFIGURED.load(Relaxed) {
        0 => default_threads(),
        n => n,
    }
}

/// Runs `f(task)` for every `task` in `0..tasks`, in parallel on the pool; returns when all have
/// run. A panic in any task resumes here once the others have finished.
pub fn for_each_task(tasks: usize, f: impl Fn(usize) + Sync) {
    if tasks <= 1 {
        return (0..tasks).for_each(f);
    }
    let mut guard = match POOL.try_lock() {
        Ok(g) => g,
        // A panic resumed out of a region poisons the lock; the pool itself is consistent (every
        // task was accounted for), so it is used on.
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        // Another thread's region, or ours from inside a task: run here.
        Err(TryLockError::WouldBlock) => return (0..tasks).for_each(f),
    };
    if guard.is_none() {
        match Pool::new(threads()) {
            Ok(p) => *guard = Some(p),
            // No worker could start: this thread does all the work.
            Err(_) => return (0..tasks).for_each(f),
        }
    }
    let pool = guard.as_mut().expect("made above");
    if pool.threads == 1 {
        return (0..tasks).for_each(f);
    }
    pool.region(tasks, &f);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once() {
        let pool_threads = 3;
        let mut pool = Pool::new(pool_threads).expect("pool");
        for tasks in [0usize, 1, 2, 7, 64, 1000] {
            let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            pool.region(tasks, &|t| {
                hits[t].fetch_add(1, Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "{tasks} tasks");
        }
    }

    #[test]
    fn a_panicking_task_resumes_on_the_caller_after_the_others_finish() {
        let mut pool = Pool::new(2).expect("pool");
        let finished = AtomicU32::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.region(16, &|t| {
                if t == 3 {
                    panic!("task 3");
                }
                std::thread::sleep(Duration::from_millis(1));
                finished.fetch_add(1, Relaxed);
            })
        }));
        let msg = r.expect_err("the panic comes back").downcast::<&str>().map(|s| *s).unwrap_or("?");
        assert_eq!(msg, "task 3");
        assert_eq!(finished.load(Relaxed), 15);
        // The pool still works afterwards.
        let n = AtomicU32::new(0);
        pool.region(8, &|_| {
            n.fetch_add(1, Relaxed);
        });
        assert_eq!(n.load(Relaxed), 8);
    }

    #[test]
    fn workers_park_and_wake() {
        let mut pool = Pool::new(2).expect("pool");
        // It parks SPIN after it last had work; on a loaded machine the thread may first wait for
        // a core, so poll (up to a second) instead of sleeping a fixed multiple of SPIN.
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while !pool.shared.parked[0].load(SeqCst) && std::time::Instant::now() < deadline {
            std::thread::sleep(SPIN);
        }
        assert!(pool.shared.parked[0].load(SeqCst), "an idle worker parks after spinning");
        let n = AtomicU32::new(0);
        pool.region(4, &|_| {
            n.fetch_add(1, Relaxed);
        });
        assert_eq!(n.load(Relaxed), 4);
    }

    #[test]
    fn nested_and_concurrent_regions_run_inline() {
        let total = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for_each_task(4, |_| for_each_task(5, |_| {
                        total.fetch_add(1, Relaxed);
                    }))
                });
            }
        });
        assert_eq!(total.load(Relaxed), 3 * 4 * 5);
    }

    #[test]
    fn thread_counts_are_checked() {
        assert_eq!(check_threads(0), Err(ThreadsError::Zero));
        assert_eq!(check_threads(MAX_THREADS + 1), Err(ThreadsError::TooMany { asked: MAX_THREADS + 1, max: MAX_THREADS }));
        assert_eq!(set_threads(0), Err(ThreadsError::Zero));
        assert_eq!((check_threads(1), check_threads(MAX_THREADS)), (Ok(1), Ok(MAX_THREADS)));
        assert!(default_threads() >= 1);
    }
}
