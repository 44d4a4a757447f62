// Package socket finds the container runtime's CRI socket on a node: it looks where the common
// distributions put it (under a root prefix when the host's directories are mounted into a pod), keeps the
// first socket that answers CRI's Version, and, when none does, says at every path what stood in the way.
package socket
