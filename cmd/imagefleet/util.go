package main

import (
	"context"
)

// contextTimeout bounds a command's wait by --timeout.
func contextTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, g.timeout)
}
