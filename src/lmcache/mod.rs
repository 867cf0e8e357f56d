//! LMCache drop-in frontend: speaks LMCache's multiprocess-server wire protocol (ZMQ ROUTER,
//! one msgpack document per frame) so unmodified LMCache clients (and vLLM through them) store
//! and retrieve through kvnode's core, with its storage, liveness and limits.
//!
//! `wire` decodes and encodes frames exactly as LMCache's msgspec does; `frontend` maps each
//! LMCache request onto the native core (sessions and per-key pending transfers live here, per
//! client connection); `server` owns the ZMQ socket on one I/O thread and runs handlers on
//! threads chosen by the client's identity, where `turns` serves the clients sharing a handler
//! in turn, within byte budgets; `handler` runs one request, on a handler thread or, when it is
//! small and its connection idle, on the I/O thread itself.

pub mod access;
pub mod bounded;
pub mod frontend;
pub mod handler;
pub mod pending;
pub mod reply;
pub mod server;
pub mod turns;
pub mod wire;

/// Normalises an LMCache `--shm-name` the way LMCache does: strip leading `/`, add the
/// `lmcache_l1_pool_` prefix unless present.
pub fn shm_segment_name(name: &str) -> String {
    let n = name.trim_start_matches('/');
    if n.starts_with("lmcache_l1_pool_") {
        n.to_owned()
    } else {
        format!("lmcache_l1_pool_{n}")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn shm_names_follow_lmcache() {
        assert_eq!(
            super::shm_segment_name("/test_pool"),
            "lmcache_l1_pool_test_pool"
        );
        assert_eq!(
            super::shm_segment_name("lmcache_l1_pool_x"),
            "lmcache_l1_pool_x"
        );
    }
}

#[cfg(test)]
mod frontend_tests;
