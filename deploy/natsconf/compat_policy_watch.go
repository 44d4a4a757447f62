// The node rights of the earlier ImageGCPolicy delivery: its GC executor watched its key of
// events.GCPolicyBucket with an ordered consumer filtered to that key, where the current one reads the key
// with a direct get on each notice of the controller (bus.FollowKey). Without them an agent of that release,
// run with credentials made by this one (the auth callout rolled first, as docs/upgrading.md says), could not
// read its policy at all, and one that started meanwhile would GC by its flags alone, its pins lifted.
//
// Remove when: no agent of the release that watched its policy key runs (docs/upgrading.md, "Compatibility
// paths").

package natsconf

// legacyPolicyWatchPermissions are node's rights to watch its own key of bucket: create an ordered consumer
// filtered to that key (never another's), fetch from it and delete it. api is the bucket's API prefix in the
// node's layout, t the node's token.
func legacyPolicyWatchPermissions(api, bucket, t string) []string {
	return []string{
		api + "CONSUMER.CREATE.KV_" + bucket + ".*.$KV." + bucket + "." + t,
		api + "CONSUMER.MSG.NEXT.KV_" + bucket + ".*",
		api + "CONSUMER.DELETE.KV_" + bucket + ".*",
	}
}
