"""`kvtier simulate`: replay request traces through a cluster model built on `kvtier.lru.LRUIndex`."""
