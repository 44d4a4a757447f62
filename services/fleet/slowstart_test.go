package fleet

import (
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestSlowStartBatch reproduces the ReplicaSet controller's TestSlowStartBatch (initial batch 1, count 10):
// fn increments a shared counter and fails once the counter exceeds callLimit.
func TestSlowStartBatch(t *testing.T) {
	fakeErr := errors.New("fake error")
	callCnt := 0
	var mu sync.Mutex
	fn := func(callLimit int) func(int) error {
		return func(int) error {
			mu.Lock()
			defer mu.Unlock()
			callCnt++
			if callCnt > callLimit {
				return fakeErr
			}
			return nil
		}
	}
	cases := []struct {
		name             string
		count, callLimit int
		wantSuccesses    int
		wantErr          error
		wantCalls        int
		wantBatches      []int
	}{
		{"callLimit = 0 (all fail)", 10, 0, 0, fakeErr, 1, []int{1}},
		{"callLimit = count (all succeed)", 10, 10, 10, nil, 10, []int{1, 2, 4, 3}},
		{"callLimit < count (some succeed)", 10, 5, 5, fakeErr, 7, []int{1, 2, 4}},
		{"count = 0", 0, 0, 0, nil, 0, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			callCnt = 0
			successes, batches, _, err := slowStartBatch(tc.count, SlowStartInitialBatchSize, 0, 0, nil, fn(tc.callLimit))
			if successes != tc.wantSuccesses {
				t.Errorf("successes = %d, want %d", successes, tc.wantSuccesses)
			}
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Errorf("err = %v, want %v", err, tc.wantErr)
			}
			if callCnt != tc.wantCalls {
				t.Errorf("calls = %d, want %d", callCnt, tc.wantCalls)
			}
			if !slices.Equal(batches, tc.wantBatches) {
				t.Errorf("batches = %v, want %v", batches, tc.wantBatches)
			}
		})
	}
}

func TestSlowStartBatchIndicesAndConcurrency(t *testing.T) {
	// Every index is called once, in batch order; the calls of one batch overlap (a batch of 4 waits until
	// all 4 are running, which would deadlock if they ran one by one).
	const count = 7
	var seen [count]atomic.Int32
	gate := map[int]*sync.WaitGroup{}
	for _, b := range [][2]int{{0, 1}, {1, 2}, {3, 4}} {
		wg := &sync.WaitGroup{}
		wg.Add(b[1])
		for i := b[0]; i < b[0]+b[1]; i++ {
			gate[i] = wg
		}
	}
	n, _, _, err := slowStartBatch(count, 1, 0, 0, nil, func(i int) error {
		seen[i].Add(1)
		gate[i].Done()
		gate[i].Wait()
		return nil
	})
	if n != count || err != nil {
		t.Fatalf("slowStartBatch = %d, %v", n, err)
	}
	for i := range seen {
		if seen[i].Load() != 1 {
			t.Errorf("index %d called %d times", i, seen[i].Load())
		}
	}
}

func TestPlanBatches(t *testing.T) {
	cases := []struct {
		name           string
		count, initial int
		want           []int
	}{
		{"ten from one", 10, 1, []int{1, 2, 4, 3}},
		{"one node", 1, 1, []int{1}},
		{"none", 0, 1, nil},
		{"initial larger than count", 3, 5, []int{3}},
		{"initial two", 20, 2, []int{2, 4, 8, 6}},
		{"thousand", 1000, 1, []int{1, 2, 4, 8, 16, 32, 64, 128, 256, 489}},
		{"zero initial", 5, 0, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := PlanBatches(tc.count, tc.initial)
			if !slices.Equal(got, tc.want) {
				t.Fatalf("PlanBatches(%d, %d) = %v, want %v", tc.count, tc.initial, got, tc.want)
			}
			sum := 0
			for _, b := range got {
				sum += b
			}
			if tc.initial > 0 && sum != tc.count {
				t.Fatalf("batches sum to %d, want %d", sum, tc.count)
			}
		})
	}
}

// TestSlowStartBatchMaxInFlight: with a cap, no more than maxInFlight calls of a batch run at once, every
// call of a started batch still runs (a failure inside the batch does not stop its other calls), and a
// failed batch stops the next one, as without a cap.
func TestSlowStartBatchMaxInFlight(t *testing.T) {
	cases := []struct {
		name          string
		count, max    int
		failAt        int // index that fails (-1: none)
		wantSuccesses int
		wantCalls     int
		wantBatches   []int
	}{
		{"all succeed, cap 4", 100, 4, -1, 100, 100, []int{1, 2, 4, 8, 16, 32, 37}},
		{"cap 1 is one at a time", 20, 1, -1, 20, 20, []int{1, 2, 4, 8, 5}},
		// Index 20 is in the 5th batch (15..30): all 16 of its calls run, the 6th batch never starts.
		{"a failure inside a capped batch", 100, 3, 20, 30, 31, []int{1, 2, 4, 8, 16}},
		{"cap above the batch sizes", 10, 1000, -1, 10, 10, []int{1, 2, 4, 3}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var running, peak, calls atomic.Int64
			seen := make([]atomic.Int64, tc.count)
			fn := func(i int) error {
				n := running.Add(1)
				for {
					p := peak.Load()
					if n <= p || peak.CompareAndSwap(p, n) {
						break
					}
				}
				calls.Add(1)
				seen[i].Add(1)
				// Long enough for every goroutine of a batch to be running at once if nothing capped them.
				time.Sleep(2 * time.Millisecond)
				running.Add(-1)
				if i == tc.failAt {
					return errors.New("fake error")
				}
				return nil
			}
			successes, batches, _, err := slowStartBatch(tc.count, 1, tc.max, 0, nil, fn)
			if (err != nil) != (tc.failAt >= 0) {
				t.Errorf("err = %v", err)
			}
			if successes != tc.wantSuccesses || int(calls.Load()) != tc.wantCalls || !slices.Equal(batches, tc.wantBatches) {
				t.Errorf("successes %d, calls %d, batches %v; want %d, %d, %v", successes, calls.Load(), batches,
					tc.wantSuccesses, tc.wantCalls, tc.wantBatches)
			}
			if p := peak.Load(); p > int64(tc.max) {
				t.Errorf("%d calls ran at once, cap %d", p, tc.max)
			}
			for i := range tc.wantCalls {
				if n := seen[i].Load(); n != 1 {
					t.Errorf("call %d ran %d times", i, n)
				}
			}
		})
	}
}

// TestSlowStartBatchBudget: with a failure budget, the next batch starts while the failures of all batches
// so far are within it; the batch that takes them over it is the last, and its first error is returned. A
// budget of 0 is the ReplicaSet controller's rule, whatever the cap in flight.
func TestSlowStartBatchBudget(t *testing.T) {
	cases := []struct {
		name          string
		count, budget int
		maxInFlight   int
		failing       []int // indexes that fail; batches of 10 from 1: 0 | 1-2 | 3-6 | 7-9
		wantSuccesses int
		wantFailures  int
		wantBatches   []int
		wantErr       bool
	}{
		{"budget 0 stops at the first failing batch", 10, 0, 0, []int{2}, 2, 1, []int{1, 2}, true},
		{"failures within the budget: every batch runs", 10, 2, 0, []int{2, 5}, 8, 2, []int{1, 2, 4, 3}, false},
		{"counted across batches: the third failure stops", 10, 2, 0, []int{0, 2, 5}, 4, 3, []int{1, 2, 4}, true},
		{"the batch that exceeds runs to its end", 10, 1, 0, []int{3, 4, 5}, 4, 3, []int{1, 2, 4}, true},
		{"a budget past the count never stops", 10, 20, 0, []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, 0, 10, []int{1, 2, 4, 3}, false},
		{"failures equal to the budget are within it", 10, 3, 0, []int{7, 8, 9}, 7, 3, []int{1, 2, 4, 3}, false},
		{"capped in flight, counted the same", 10, 1, 1, []int{1, 7, 8}, 7, 3, []int{1, 2, 4, 3}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int64
			fakeErr := errors.New("fake error")
			fn := func(i int) error {
				calls.Add(1)
				if slices.Contains(tc.failing, i) {
					return fakeErr
				}
				return nil
			}
			successes, batches, failures, err := slowStartBatch(tc.count, 1, tc.maxInFlight, tc.budget, nil, fn)
			if successes != tc.wantSuccesses || failures != tc.wantFailures || !slices.Equal(batches, tc.wantBatches) {
				t.Errorf("successes %d, failures %d, batches %v; want %d, %d, %v", successes, failures, batches,
					tc.wantSuccesses, tc.wantFailures, tc.wantBatches)
			}
			if (err != nil) != tc.wantErr || (err != nil && !errors.Is(err, fakeErr)) {
				t.Errorf("err = %v, want an error: %v", err, tc.wantErr)
			}
			ran := 0
			for _, b := range tc.wantBatches {
				ran += b
			}
			if int(calls.Load()) != ran {
				t.Errorf("%d calls, want every call of the %v batches (%d)", calls.Load(), tc.wantBatches, ran)
			}
		})
	}
}
