package fleet

import (
	"maps"
	"slices"
	"strings"
	"testing"
)

// FuzzParseLabels: --node-labels of any content never panics; what parses is valid and parses again to
// the same labels when written back.
func FuzzParseLabels(f *testing.F) {
	for _, s := range []string{"fleet=lab,zone=z1", "a=", "=b", "a=b,a=c", "example.com/role=edge", " x = y ", ",,,", "k=v=w"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := ParseLabels(s)
		if err != nil {
			return
		}
		var parts []string
		for _, k := range slices.Sorted(maps.Keys(got)) {
			parts = append(parts, k+"="+got[k])
		}
		again, err := ParseLabels(strings.Join(parts, ","))
		if err != nil {
			t.Fatalf("labels %v from %q do not parse again: %v", got, s, err)
		}
		if !maps.Equal(got, again) {
			t.Fatalf("labels %v from %q parse again as %v", got, s, again)
		}
		if _, err := ParseSelector(strings.Join(parts, ",")); err != nil {
			t.Fatalf("labels %v are not a valid selector: %v", got, err)
		}
	})
}
