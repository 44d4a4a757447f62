// Package cri is the only code that speaks CRI (k8s.io/cri-api v1) over gRPC. It maps gRPC status codes to
// the sentinels below once, puts a timeout on every call, and converts CRI messages to small Go types.
package cri
