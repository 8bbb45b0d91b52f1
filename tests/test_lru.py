from kvtier.lru import LRUIndex


def test_evicts_least_recently_used_first():
    idx = LRUIndex(capacity=3)
    for key in "abc":
        assert idx.insert(key, 1) == []
    idx.touch("a")
    assert idx.insert("d", 1) == [("b", 1)]
    assert list(idx) == ["c", "a", "d"]
    assert idx.insert("e", 2) == [("c", 1), ("a", 1)]
    assert list(idx) == ["d", "e"] and idx.used == 3 and idx.num_evictions == 3


def test_too_big_or_all_pinned_is_refused_without_change():
    idx = LRUIndex(capacity=4)
    idx.insert("a", 2)
    idx.insert("b", 2)
    assert idx.insert("huge", 5) is None
    assert idx.insert("c", 2, pinned={"a", "b"}) is None
    assert list(idx) == ["a", "b"] and idx.used == 4
    assert idx.insert("c", 2, pinned={"a"}) == [("b", 2)]


def test_reinsert_refreshes_size_and_recency():
    idx = LRUIndex(capacity=10)
    idx.insert("a", 3)
    idx.insert("b", 3)
    idx.insert("a", 5)
    assert list(idx) == ["b", "a"] and idx.used == 8
    assert idx.pop("b") == 3 and idx.pop("b") is None and idx.used == 5


def test_zero_and_unbounded_capacity():
    assert LRUIndex(0).insert("a", 1) is None
    unbounded = LRUIndex(None)
    for i in range(1000):
        assert unbounded.insert(i, 7) == []
    assert unbounded.used == 7000


def test_refused_refresh_of_a_present_key_changes_nothing():
    idx = LRUIndex(10)
    idx.insert("a", 4)
    idx.insert("b", 4)
    assert idx.insert("a", 9, pinned=["b"]) is None  # would need b out, b is pinned
    assert list(idx) == ["a", "b"] and idx.used == 8 and idx.size_of("a") == 4
    assert idx.insert("a", 7) == [("b", 4)] and list(idx) == ["a"] and idx.used == 7


def test_touch_many_refreshes_a_chain_tail_first():
    idx = LRUIndex(capacity=4)
    for key in "abcd":
        idx.insert(key, 1)
    idx.touch_many(["a", "b", "x"])  # a chain, root first; absent keys skipped
    assert list(idx) == ["c", "d", "b", "a"]  # its root the most recent
    assert idx.insert("e", 1) == [("c", 1)]
