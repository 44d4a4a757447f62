package integration_test

import "github.com/imagefleet/imagefleet/internal/testenv"

// An IMAGEFLEET_* variable no test reads (a mistyped knob) stops the run before any test: docs/testing.md.
func init() { testenv.MustCheck() }
