package bustest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
)

// Timeout is how long WaitFor waits for a condition.
const Timeout = 15 * time.Second

// StopTimeout is how long RunService waits for Run to return after its context is cancelled.
const StopTimeout = 30 * time.Second

// errNotYet is what WaitFor reports when the condition was simply false.
var errNotYet = errors.New("condition still false")

// WaitFor polls cond until it holds; after Timeout it fails the test with what was awaited.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	WaitWithin(t, what, Timeout, cond)
}

// WaitClosed waits until ch is closed (a worker's Ready, a Started callback's signal); after Timeout it fails
// the test with what was awaited.
func WaitClosed(t testing.TB, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(Timeout):
		t.Fatalf("%s: not after %v", what, Timeout)
	}
}

// WaitWithin is WaitFor with its own timeout, for a test whose assertion is the time ("within a second").
func WaitWithin(t testing.TB, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	Eventually(t, what, timeout, func() error {
		if cond() {
			return nil
		}
		return errNotYet
	})
}

// Eventually polls cond until it returns nil; after timeout it fails the test with what was awaited and the
// last error cond returned. It polls at once, then every 5 ms growing to 100 ms, so a fast condition is met
// quickly and a slow one (a CLI run, a query to a node) is not asked too often. In a testing/synctest bubble
// it waits on the bubble's clock.
func Eventually(t testing.TB, what string, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	interval := 5 * time.Millisecond
	for {
		err := cond()
		if err == nil {
			return
		}
		if !time.Now().Before(deadline) {
			t.Fatalf("timed out after %v waiting for %s; last: %v", timeout, what, err)
		}
		timer := time.NewTimer(min(interval, time.Until(deadline)))
		<-timer.C
		interval = min(2*interval, 100*time.Millisecond)
	}
}

// Service is a worker: Run serves until ctx is cancelled, then returns nil.
type Service interface {
	Run(ctx context.Context) error
}

// RunService runs svc.Run in a goroutine until stop is called or the test ends: then it cancels Run's context
// and fails the test if Run returned an error (a Run that returned early is reported when it is stopped) or
// did not return within StopTimeout. stop may be called more than once; call RunService after bustest.Start
// (and after VerifyNoLeaks), so the worker stops before the bus closes and before leaks are counted.
func RunService(t testing.TB, svc Service) (stop func()) {
	t.Helper()
	return RunFunc(t, fmt.Sprintf("%T", svc), svc.Run)
}

// RunFunc is RunService for a run function; name says which worker in a failure.
func RunFunc(t testing.TB, name string, run func(context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			t.Helper()
			cancel()
			timer := time.NewTimer(StopTimeout)
			defer timer.Stop()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("%s: Run returned %v", name, err)
				}
			case <-timer.C:
				t.Errorf("%s: Run did not return within %v of its context's cancel", name, StopTimeout)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}
