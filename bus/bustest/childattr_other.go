//go:build !linux

package bustest

import "syscall"

// childAttr: no parent-death signal outside Linux; the cleanup stops the servers.
func childAttr() *syscall.SysProcAttr { return nil }
