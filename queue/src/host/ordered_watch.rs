//! A `watch` whose waiters wake in the order they began to wait.
//!
//! A tokio `watch` receiver waits on one of eight `Notify`s picked by the runtime's random
//! generator, which the OS seeds, so the receivers one send wakes (a range's deliveries when its
//! lease is renewed, a partition's resting ranges when its probe announces) run in another
//! order each time, and no simulated history where several wait at once replays exactly. Here
//! the value lives in a `watch` (read, marked seen, closed with its sender) and waiters wait on
//! one [`Notify`], which wakes them first come, first served.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::{watch, Notify};

#[derive(Default)]
struct Wakes {
    notify: Notify,
    /// The sender is gone (set before its waiters are woken, while its `watch` still lives).
    closed: AtomicBool,
}

/// The sending half: every change wakes the receivers waiting in [`Receiver::changed`].
pub(crate) struct Sender<T> {
    tx: watch::Sender<T>,
    wakes: Arc<Wakes>,
}

/// The receiving half.
pub(crate) struct Receiver<T> {
    rx: watch::Receiver<T>,
    wakes: Arc<Wakes>,
}

/// The sender is gone.
#[derive(Debug)]
pub(crate) struct Closed;

impl<T> Sender<T> {
    pub(crate) fn new(value: T) -> Self {
        Self {
            tx: watch::Sender::new(value),
            wakes: Arc::default(),
        }
    }

    pub(crate) fn send_replace(&self, value: T) -> T {
        let old = self.tx.send_replace(value);
        self.wakes.notify.notify_waiters();
        old
    }

    pub(crate) fn send_modify(&self, modify: impl FnOnce(&mut T)) {
        self.tx.send_modify(modify);
        self.wakes.notify.notify_waiters();
    }

    pub(crate) fn send_if_modified(&self, modify: impl FnOnce(&mut T) -> bool) -> bool {
        let modified = self.tx.send_if_modified(modify);
        if modified {
            self.wakes.notify.notify_waiters();
        }
        modified
    }

    pub(crate) fn borrow(&self) -> watch::Ref<'_, T> {
        self.tx.borrow()
    }

    pub(crate) fn subscribe(&self) -> Receiver<T> {
        Receiver {
            rx: self.tx.subscribe(),
            wakes: Arc::clone(&self.wakes),
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        self.wakes.closed.store(true, Ordering::Release);
        self.wakes.notify.notify_waiters();
    }
}

impl<T> Clone for Receiver<T> {
    fn clone(&self) -> Self {
        Self {
            rx: self.rx.clone(),
            wakes: Arc::clone(&self.wakes),
        }
    }
}

impl<T> Receiver<T> {
    pub(crate) fn borrow(&self) -> watch::Ref<'_, T> {
        self.rx.borrow()
    }

    /// The value, marked seen.
    pub(crate) fn borrow_and_update(&mut self) -> watch::Ref<'_, T> {
        self.rx.borrow_and_update()
    }

    /// Whether a value not yet seen was sent; [`Closed`] once the sender is gone.
    pub(crate) fn has_changed(&self) -> Result<bool, Closed> {
        if self.wakes.closed.load(Ordering::Acquire) {
            return Err(Closed);
        }
        self.rx.has_changed().map_err(|_| Closed)
    }

    /// Resolves once a value not yet seen was sent (marking it seen), or the sender is gone.
    pub(crate) async fn changed(&mut self) -> Result<(), Closed> {
        loop {
            let woken = self.wakes.notify.notified();
            tokio::pin!(woken);
            // Listed as a waiter before looking, so a send after the look wakes it.
            woken.as_mut().enable();
            if self.has_changed()? {
                self.rx.borrow_and_update();
                return Ok(());
            }
            woken.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Receivers waiting on one send wake in the order they began to wait, every time; and a
    /// sender that goes wakes them with [`Closed`].
    #[tokio::test(start_paused = true)]
    async fn waiters_wake_in_the_order_they_came_and_see_the_sender_go() {
        let sender = Sender::new(0u32);
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..32 {
            let (mut rx, order) = (sender.subscribe(), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                rx.changed().await.unwrap();
                order.lock().unwrap().push(i);
                rx.changed().await.unwrap_err();
            }));
            tokio::task::yield_now().await; // it waits before the next one starts
        }
        sender.send_replace(1);
        tokio::task::yield_now().await;
        assert_eq!(*order.lock().unwrap(), (0..32).collect::<Vec<_>>());
        drop(sender);
        for task in tasks {
            task.await.unwrap();
        }
    }
}
