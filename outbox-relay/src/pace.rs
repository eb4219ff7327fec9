//! When the pump claims next: at once while batches come back full, after a growing idle wait
//! while there is little to do, after a backoff when nothing went through.

use crate::config::{RelayConfig, Wakeup, backoff};
use std::time::Duration;
use tokio::time::Instant;

/// When the loop claims next: at once while batches come back full, after a growing idle wait
/// while there is little to do, after a backoff when nothing went through.
pub(crate) struct Pace {
    max_backoff: Duration,
    min_poll_interval: Duration,
    poll_interval: Duration,
    wakeup: Wakeup,
    publish_backoff: Box<dyn Iterator<Item = Duration> + Send>,
    idle: Box<dyn Iterator<Item = Duration> + Send>,
    /// Claim no sooner than this, and why.
    next_claim: Option<(Instant, Pause)>,
}

/// Why the loop waits before it claims again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pause {
    /// Little to do: the next poll. A notification cuts it short.
    Idle,
    /// Nothing of the last batch went through. A notification cuts it short.
    Backoff,
    /// The broker refuses the relay: notifications do not cut it short.
    Refused,
}

impl Pace {
    pub fn new(config: &RelayConfig) -> Self {
        let mut pace = Pace {
            max_backoff: config.max_backoff,
            min_poll_interval: config.min_poll_interval,
            poll_interval: config.poll_interval,
            wakeup: config.wakeup,
            publish_backoff: Box::new(backoff(config.max_backoff)),
            idle: Box::new(std::iter::empty()),
            next_claim: None,
        };
        pace.idle = pace.idle_waits();
        pace
    }

    /// Whether the loop may claim now.
    pub fn go_on(&self) -> bool {
        self.next_claim.is_none()
    }

    /// Whether the loop backs off (after a failure), rather than waiting for its next poll.
    pub fn backing_off(&self) -> bool {
        matches!(self.next_claim, Some((_, Pause::Backoff | Pause::Refused)))
    }

    /// Until when to wait before the next claim, and whether a notification may cut it short.
    pub fn wait(&mut self) -> Option<(Instant, bool)> {
        if self
            .next_claim
            .is_some_and(|(until, _)| until <= Instant::now())
        {
            self.next_claim = None;
        }
        self.next_claim
            .map(|(until, pause)| (until, pause != Pause::Refused))
    }

    /// A notification came: claim now.
    pub fn notified(&mut self) {
        if self
            .next_claim
            .is_some_and(|(_, pause)| pause != Pause::Refused)
        {
            self.next_claim = None;
        }
    }

    /// The broker refuses the relay: wait the next backoff, whatever notifications say.
    pub fn refused(&mut self) -> Duration {
        let delay = self.publish_backoff.next().unwrap_or(self.max_backoff);
        self.next_claim = Some((Instant::now() + delay, Pause::Refused));
        delay
    }

    /// Nothing of a batch went through.
    pub fn failed(&mut self) {
        let delay = self.publish_backoff.next().unwrap_or(self.max_backoff);
        self.next_claim = Some((Instant::now() + delay, Pause::Backoff));
    }

    /// Some of a batch went through: go on at once after a full batch, poll soon otherwise.
    pub fn published(&mut self, full: bool) {
        self.publish_backoff = Box::new(backoff(self.max_backoff));
        if !full {
            self.idle = self.idle_waits();
            self.idle_wait();
        }
    }

    /// A claim found nothing to send: poll less and less often, up to the poll interval.
    pub fn found_nothing(&mut self) {
        if self.next_claim.is_none() {
            self.idle_wait();
        }
    }

    fn idle_wait(&mut self) {
        let delay = self.idle.next().unwrap_or(self.poll_interval);
        self.next_claim = Some((Instant::now() + delay, Pause::Idle));
    }

    /// The waits between polls that find nothing: the minimum poll interval, doubling up to the
    /// poll interval. With NOTIFY, notifications are the fast path and polling only the
    /// fallback: always the interval.
    fn idle_waits(&self) -> Box<dyn Iterator<Item = Duration> + Send> {
        let max = self.poll_interval;
        let first = match self.wakeup {
            Wakeup::Poll => self.min_poll_interval.min(max),
            Wakeup::Notify => max,
        };
        Box::new(std::iter::successors(Some(first), move |d| {
            Some((*d * 2).min(max))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `step` sets a wait of `expected`: the wait ends `expected` after a moment between
    /// the step's start and end, whatever the clock did meanwhile.
    fn sets_wait(pace: &mut Pace, step: impl FnOnce(&mut Pace), expected: Duration) -> bool {
        let before = Instant::now();
        step(pace);
        let after = Instant::now();
        let (until, _) = pace.wait().expect("a wait");
        until - after <= expected && expected <= until - before
    }

    #[tokio::test]
    async fn after_work_the_minimum_poll_interval_then_doubling_up_to_the_poll_interval() {
        let mut config = RelayConfig::new("postgres://db/shop");
        config.min_poll_interval = Duration::from_millis(5);
        config.poll_interval = Duration::from_millis(30);
        let mut pace = Pace::new(&config);
        assert!(pace.go_on(), "the first claim goes at once");
        pace.published(true);
        assert!(pace.go_on(), "a full batch loops at once");

        let ms = Duration::from_millis;
        assert!(sets_wait(&mut pace, |p| p.published(false), ms(5)));
        for expected in [10, 20, 30, 30] {
            let (until, _) = pace.wait().expect("a wait");
            tokio::time::sleep_until(until).await;
            assert!(pace.wait().is_none(), "the wait is over");
            assert!(
                sets_wait(&mut pace, Pace::found_nothing, ms(expected)),
                "{expected} ms"
            );
        }
    }
}
