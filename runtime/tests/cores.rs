//! The process's CPU cores (`kernels::Cores`): held by one thread at a time, granted in the order
//! asked for, and held again at once by the thread that holds them (a pass inside a node's
//! batch). Alone in its test binary: no other test here holds or waits for them.

use tandem_runtime::kernels::Cores;

/// Waits until `n` threads hold the cores or wait for them.
fn queued(n: u64) {
    while Cores::queued() < n {
        std::thread::yield_now();
    }
}

#[test]
fn the_cores_are_held_in_turn_and_again_by_their_holder() {
    let (busy, ended, last) = Cores::state();
    assert!(!busy && last.is_none(), "no hold yet");
    let first = Cores::hold();
    let again = Cores::hold();
    drop(again);
    assert_eq!(Cores::queued(), 1, "a hold inside a hold takes no turn");
    assert!(Cores::state().0, "held");
    let (order, turns) = std::sync::mpsc::channel();
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let order = order.clone();
            let waiter = std::thread::spawn(move || {
                let _cores = Cores::hold();
                order.send(i).expect("the test reads");
            });
            // The second asks once the first waits.
            queued(i + 2);
            waiter
        })
        .collect();
    assert!(
        turns.try_recv().is_err(),
        "a waiter ran while the cores were held"
    );
    drop(first);
    for waiter in waiters {
        waiter.join().expect("waiter");
    }
    assert_eq!(
        turns.try_iter().collect::<Vec<_>>(),
        [0, 1],
        "in the order asked"
    );
    assert_eq!(Cores::queued(), 0);
    let (busy, now_ended, last) = Cores::state();
    assert!(!busy, "free");
    assert_eq!(now_ended - ended, 3, "three holds ended (none inside one)");
    assert!(last.is_some_and(|t| t <= std::time::Instant::now()));
}
