// Package authcallout is nats-server's auth callout for imagefleet: it lets a connection in on a Kubernetes
// ServiceAccount token the API server accepts (TokenReview), as a user with the permissions of
// deploy/natsconf for that ServiceAccount's role (a node's from the node its pod is bound to), until the token
// expires. It also keeps the Secret holding the callout's keys (EnsureKeys).
package authcallout
