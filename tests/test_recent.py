"""recent.Recent: the least recently used values go first, and with tags, every value of the least recently used
tag at once (what a kept launch holds on to)."""
import threading

from burst_hpc.recent import Recent


def test_the_least_recently_used_goes_first():
    table = Recent(3)
    for key in "abc":
        table.put(key, key.upper())
    assert table.get("a") == "A"            # a is now the most recent
    table.put("d", "D")
    assert table.get("b") is None and [table.get(k) for k in "acd"] == ["A", "C", "D"]
    assert table.made("e", lambda: "E") == "E" and table.made("e", lambda: "not made again") == "E"
    assert len(table) == 3


def test_tags_bound_what_the_values_hold():
    table = Recent(100, tags=2)
    table.put(1, "one", tag="mask a")
    table.put(2, "two", tag="mask a")
    table.put(3, "three", tag="mask b")
    table.get(1)                               # mask a is now the most recent tag
    table.put(4, "four", tag="mask c")         # a third tag: mask b's values go
    assert table.get(3) is None and table.get(1) == "one" and table.get(2) == "two" and table.get(4) == "four"
    table.put(5, "five", tag="mask d")         # mask a (used before c) goes, both its values
    assert table.get(1) is None and table.get(2) is None and table.get(5) == "five"


def test_values_dropped_by_size_leave_their_tag():
    table = Recent(2, tags=2)
    table.put(1, "one", tag="a")
    table.put(2, "two", tag="b")
    table.put(3, "three", tag="b")             # size drops 1: tag a holds nothing and is forgotten
    table.put(4, "four", tag="c")              # so only tag b's least recent value goes by size
    assert table.get(3) == "three" and table.get(4) == "four"
    assert set(table.tagged) <= {"b", "c"}


def test_threads_share_a_table():
    table, errors = Recent(8, tags=3), []

    def work(n):
        try:
            for i in range(2000):
                table.put((n, i % 20), i, tag=i % 5)
                table.get((n, (i * 7) % 20))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(table) <= 8
