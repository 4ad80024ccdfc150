//! Drive the official stream processor's futures without an async runtime: its chunk generators
//! do no I/O, so every future is ready when first polled (a pending one is polled again).

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

pub(crate) fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::yield_now();
    }
}
