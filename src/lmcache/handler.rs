//! Running one LMCache request: decode its payload, execute it as the client it came from, and
//! encode the reply frames. Handler threads run the requests queued for them (`turns`); the I/O
//! thread runs a small request itself when its connection has nothing queued or running
//! ([`runs_inline`]), which saves the two thread hand-offs (I/O thread to handler, handler back
//! through the reply queue and the wake-up socket pair) that cost more than the work itself.

use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use super::frontend::ClientId;
use super::server::{Incoming, Shared, TIMED_OPS};
use super::wire::{self, Op};

/// Largest request (payload frames together) the I/O thread runs itself. A 0.5.6 key of about
/// 1,600 to 2,700 tokens (3 to 5 bytes each) fits: the LOOKUPs, PREPAREs and COMMITs of a
/// typical prompt. Larger requests are decoded on a handler thread, so the socket thread never
/// decodes a large payload (LMCache weak point P4) and a flood of long keys waits in `turns`.
pub const INLINE_MAX_REQUEST_BYTES: usize = 8 << 10;

/// Whether `op` with `bytes` of payload may run on the I/O thread: cheap, bounded operations
/// that never wait (kvnode's lookups complete synchronously, so WAIT_PREFETCH_STATUS answers at
/// once). REGISTER, UNREGISTER, CLEAR and the rest stay on the handlers. With a disk tier
/// or a cluster (`disk_tier`: lookups may wait), LOOKUP and PREPARE_RETRIEVE may read objects
/// from the disk or fetch them from a peer node, which can take up to the tier's I/O timeout or
/// the peer deadline: they stay on the handlers, so the socket thread (every client's replies)
/// never waits for a device or a peer.
pub fn runs_inline(op: Op, bytes: usize, disk_tier: bool) -> bool {
    if bytes > INLINE_MAX_REQUEST_BYTES {
        return false;
    }
    match op {
        Op::Lookup | Op::PrepareRetrieve => !disk_tier,
        Op::Ping
        | Op::PrepareStore
        | Op::CommitStore
        | Op::QueryPrefetchStatus
        | Op::WaitPrefetchStatus
        | Op::QueryPrefetchLookupHits
        | Op::CommitRetrieve
        | Op::EndSession
        | Op::FreeLookupLocks => true,
        _ => false,
    }
}

/// Decodes and executes `req`; returns its reply frames `[identity, uid, type, (payload)]`
/// and records its server-side time in the frontend's stats. Never panics on bad input: a
/// payload that does not decode, or is over a limit, gets the operation's negative answer.
pub(super) fn execute(s: &Shared, req: Incoming) -> Vec<Vec<u8>> {
    let started = Instant::now();
    let max_tokens = s.frontend.limits().max_tokens_per_request;
    let client = ClientId::from_shared(req.identity.clone(), req.peer_uid).with_stamp(req.stamp);
    let payload: Vec<&[u8]> = req.payload.iter().map(Vec::as_slice).collect();
    // A negative answer because the request was refused or failed (the metrics' errors).
    let mut failed = false;
    let reply = match wire::decode_request_limited(req.op, &req.name, &payload, max_tokens) {
        Ok(r) => {
            if matches!(r, wire::LmRequest::Unsupported { .. }) {
                s.stats.unsupported.fetch_add(1, Ordering::Relaxed);
                failed = true;
            }
            // A bug must not leave the client waiting for its whole timeout.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                s.frontend.handle(&client, r)
            }))
            .unwrap_or_else(|_| {
                failed = true;
                tracing::error!(op = %req.name, "LMCache handler panicked (bug); answering negatively");
                s.frontend.stateless_reply(req.op)
            })
        }
        Err(e @ wire::WireError::Limit { .. }) => {
            s.frontend
                .counters()
                .over_limit
                .fetch_add(1, Ordering::Relaxed);
            failed = true;
            if let Some(suppressed) = s.refusal_log.allow(s.now_ms()) {
                tracing::warn!(op = %req.name, %client, error = %e, suppressed, "LMCache request over a limit: answering negatively");
            }
            s.frontend.stateless_reply(req.op)
        }
        Err(e) => {
            tracing::warn!(op = %req.name, error = %e, "malformed LMCache request: answering negatively");
            s.stats.malformed.fetch_add(1, Ordering::Relaxed);
            failed = true;
            s.frontend.stateless_reply(req.op)
        }
    };
    drop(payload);
    let mut frames = vec![req.identity.to_vec(), req.uid, req.typ];
    frames.extend(reply);
    // One clock read for both: the metrics' latency from the I/O thread's receipt (queue wait
    // included), and the frontend's own time from the start of the execution.
    let done = Instant::now();
    let since = |t: Instant| u64::try_from(done.duration_since(t).as_nanos()).unwrap_or(u64::MAX);
    s.stats
        .ops
        .record_ns(req.op as usize, failed, since(req.received));
    if let Some(i) = TIMED_OPS.iter().position(|o| *o == req.op) {
        let ns = since(started);
        let t = &s.stats.op_time[i];
        t.count.fetch_add(1, Ordering::Relaxed);
        t.total_ns.fetch_add(ns, Ordering::Relaxed);
        t.max_ns.fetch_max(ns, Ordering::Relaxed);
    }
    frames
}

/// Handler thread `index`: runs the requests queued for it, connections in turn, and queues
/// each reply for the I/O thread. A request counts as running (so the I/O thread runs none of
/// its connection's requests itself) from its pop until its reply is queued.
pub(super) fn run_handler(s: &Shared, index: usize) {
    let h = &s.handlers[index];
    let _ = h.thread.set(thread::current());
    while !s.stop.load(Ordering::Acquire) {
        let next = {
            let mut q = h.queue.lock();
            let next = q.pop();
            if let Some(r) = &next {
                s.frontend.counters().queued_bytes.fetch_sub(
                    super::turns::QueuedBytes::queued_bytes(r),
                    Ordering::Relaxed,
                );
            }
            next
        };
        let Some(req) = next else {
            thread::park_timeout(Duration::from_millis(200));
            continue;
        };
        let frames = execute(s, req);
        s.push_reply(frames);
        // After the reply is queued (the I/O thread sends queued replies before any it runs
        // itself), so the connection's next small request may run on the I/O thread.
        h.queue.lock().finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_reads_and_large_payloads_stay_off_the_socket_thread() {
        assert!(runs_inline(Op::Lookup, 100, false));
        assert!(!runs_inline(Op::Lookup, 100, true));
        assert!(!runs_inline(Op::PrepareRetrieve, 100, true));
        assert!(runs_inline(Op::CommitRetrieve, 100, true));
        assert!(!runs_inline(
            Op::PrepareStore,
            INLINE_MAX_REQUEST_BYTES + 1,
            false
        ));
        assert!(!runs_inline(Op::RegisterEngineDriven, 100, false));
        assert!(!runs_inline(Op::Clear, 0, false));
    }
}
