// Compatibility path: node-first inventory keys.
//
// Before image-first keys (InventoryKey), the inventory bucket was keyed node first: <node token>.<image
// token>. The inventory's replicas index such a key under its image-first key and re-key it in place
// (services/fleet/compat_nodefirst_keys.go); they recognise it by this key.
//
// Remove when: no bucket holds a node-first key (`fleet where` of every image answers without re-keying)
// and no node-first replica runs (docs/upgrading.md, "Compatibility paths").

package events

// InventoryNodeFirstKey is the node-first layout's key of image id on node: <node token>.<image token>.
func InventoryNodeFirstKey(node, id string) string {
	return NodeToken(node) + "." + InventoryImageToken(id)
}
