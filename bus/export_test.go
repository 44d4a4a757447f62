package bus

// SyncQueueLen is syncQueueLen, for the tests of package bus_test.
const SyncQueueLen = syncQueueLen
