package fleet

import (
	"sync"
	"sync/atomic"
)

// SlowStartInitialBatchSize is the ReplicaSet controller's initial batch size (batches of 1, 2, 4, 8 ...).
const SlowStartInitialBatchSize = 1

// slowStartBatch calls fn count times in batches that grow exponentially, like the ReplicaSet controller's
// slowStartBatch (pkg/controller/replicaset/replica_set.go): the first batch has min(count,
// initialBatchSize) calls, each next one min(2*previous, remaining); the calls of a batch run concurrently
// and the batch is waited for. fn gets the index of its call, 0..count-1, in batch order, so callers can map
// calls to items; count 0 (or initialBatchSize 0) calls nothing. It returns the successful calls, the sizes
// of the batches it started, and the failed calls.
//
// onBatch(first index, size), when set, is called before each batch starts; false ends the calls there,
// that batch not started (nor counted in batches). At most maxInFlight calls of a
// batch run at once (0: all of them, as the ReplicaSet controller does). The next batch starts while the
// failed calls of all batches so far number at most maxFailures (0: none may fail, the ReplicaSet
// controller's rule). The batch that takes the failures over the budget is the last one; err is its first
// error (the first to arrive), and is nil whenever the failures stayed within the budget.
// The cap changes when a call runs, never whether: every call of a started batch still runs, even after one
// of them failed, and the batch ends when all its calls have. The calls of a batch start in index order,
// maxInFlight goroutines taking the next index as one finishes.
func slowStartBatch(count, initialBatchSize, maxInFlight, maxFailures int, onBatch func(start, size int) bool, fn func(i int) error) (successes int, batches []int, failures int, err error) {
	remaining := count
	next := 0
	for batchSize := min(remaining, initialBatchSize); batchSize > 0; batchSize = min(2*batchSize, remaining) {
		if onBatch != nil && !onBatch(next, batchSize) {
			return successes, batches, failures, nil
		}
		batches = append(batches, batchSize)
		workers := batchSize
		if maxInFlight > 0 {
			workers = min(workers, maxInFlight)
		}
		var (
			wg     sync.WaitGroup
			mu     sync.Mutex
			failed int
			first  error
			taken  atomic.Int64
		)
		start := next
		wg.Add(workers)
		for range workers {
			go func() {
				defer wg.Done()
				for {
					j := int(taken.Add(1)) - 1
					if j >= batchSize {
						return
					}
					if err := fn(start + j); err != nil {
						mu.Lock()
						failed++
						if first == nil {
							first = err
						}
						mu.Unlock()
					}
				}
			}()
		}
		wg.Wait()
		next += batchSize
		successes += batchSize - failed
		failures += failed
		if failures > maxFailures {
			return successes, batches, failures, first
		}
		remaining -= batchSize
	}
	return successes, batches, failures, nil
}

// PlanBatches returns the batch sizes slowStartBatch uses for count calls when every call succeeds.
func PlanBatches(count, initialBatchSize int) []int {
	var out []int
	remaining := count
	for batchSize := min(remaining, initialBatchSize); batchSize > 0; batchSize = min(2*batchSize, remaining) {
		out = append(out, batchSize)
		remaining -= batchSize
	}
	return out
}

// batchIndexer maps a call index to its 1-based batch number under the slow-start plan.
func batchIndexer(count, initial int) func(int) int {
	plan := PlanBatches(count, initial)
	return func(i int) int {
		end := 0
		for b, size := range plan {
			end += size
			if i < end {
				return b + 1
			}
		}
		return len(plan)
	}
}
