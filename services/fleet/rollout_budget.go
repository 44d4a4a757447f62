package fleet

import (
	"fmt"
	"strconv"
	"strings"
)

// FailureBudget is how many of a rollout's planned nodes may fail before it stops: a count, or a percentage
// of the planned nodes, as a Deployment's maxUnavailable (an int or a percent) and Ansible's
// max_fail_percentage. The rollout goes on, batch by batch, while the nodes failed so far number at most
// Allowed(planned), and stops after the batch that takes them over it. The zero value allows none.
type FailureBudget struct {
	// N is the count, or with Percent the percentage of the planned nodes (0-100).
	N       int
	Percent bool
}

// ParseFailureBudget parses a budget as --max-failures takes it: a count ("10") or a whole percentage of
// the planned nodes ("5%").
func ParseFailureBudget(s string) (FailureBudget, error) {
	num, pct := strings.CutSuffix(s, "%")
	n, err := strconv.Atoi(num)
	if err != nil || num == "" || strings.TrimSpace(num) != num || strings.HasPrefix(num, "+") {
		return FailureBudget{}, fmt.Errorf("%q is not a count (10) or a whole percentage of the planned nodes (5%%)", s)
	}
	if n < 0 {
		return FailureBudget{}, fmt.Errorf("%q must not be negative", s)
	}
	if pct && n > 100 {
		return FailureBudget{}, fmt.Errorf("%q must be at most 100%%", s)
	}
	return FailureBudget{N: n, Percent: pct}, nil
}

// String is the budget as ParseFailureBudget reads it ("0", "10", "5%").
func (b FailureBudget) String() string {
	if b.Percent {
		return strconv.Itoa(b.N) + "%"
	}
	return strconv.Itoa(b.N)
}

// IsZero reports whether the budget allows no failure whatever the rollout's size.
func (b FailureBudget) IsZero() bool { return b.N == 0 }

// Allowed is the number of failed nodes the budget allows in a rollout of planned nodes. A percentage is
// rounded down, as a Deployment's maxUnavailable is: the budget never allows more than its share (5% of 30
// nodes allows 1, 1% of 50 allows none), so a rollout stops when more than P% of its nodes failed, as
// Ansible's max_fail_percentage does.
func (b FailureBudget) Allowed(planned int) int {
	if b.Percent {
		return planned * b.N / 100
	}
	return b.N
}

func (b FailureBudget) validate() error {
	if b.N < 0 {
		return fmt.Errorf("max failures %s must not be negative", b)
	}
	if b.Percent && b.N > 100 {
		return fmt.Errorf("max failures %s must be at most 100%%", b)
	}
	return nil
}
