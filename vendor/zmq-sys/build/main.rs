// kvnode: zmq-sys 0.12.0 with one change, `.enable_draft(true)`: see ../PATCHED.md.
pub fn configure() {
    println!("cargo:rerun-if-changed=build/main.rs");
    println!("cargo:rerun-if-env-changed=PROFILE");

    // Note that by default `libzmq` builds without `libsodium` by instead
    // relying on `tweetnacl`. However since this `tweetnacl` [has never been
    // audited nor is ready for production](https://github.com/zeromq/libzmq/issues/3006),
    // we link against `libsodium` to enable `ZMQ_CURVE`.
    //
    // The DRAFT API is enabled for ZMQ_ROUTER_NOTIFY (a draft socket option in libzmq 4.3.4:
    // without it, setting the option fails with EINVAL). Draft options change nothing unless
    // a program sets them.
    zeromq_src::Build::new()
        .with_libsodium(None)
        .enable_draft(true)
        .build();
}

fn main() {
    configure()
}
