"""Which accounts a sweep keeps (routing/admission/accountkeeps.py): every account at first
and after a loss, then only those with entries kept lately and those due."""

from __future__ import annotations

from routing.admission.accountkeeps import RECENT, AccountKeeps


def keep_all(keeps: AccountKeeps, entries: dict[str, list[str]], round_: int) -> None:
    due, everyone = keeps.due(entries, round_)
    for key, ids, whole in due:
        keeps.kept(key, ids, round_, whole, restored=False)
    keeps.done(everyone, answered=True)


def keys(keeps: AccountKeeps, entries: dict[str, list[str]], round_: int) -> list[str]:
    return [key for key, _, _ in keeps.due(entries, round_)[0]]


def test_the_first_round_keeps_every_account_then_only_recent_entries_and_due_accounts() -> None:
    keeps = AccountKeeps(every=10)
    entries = {"a": ["1"], "b": ["2"]}
    assert keeps.due(entries, 0) == ([("a", ["1"], True), ("b", ["2"], True)], True)
    keep_all(keeps, entries, 0)
    for r in range(1, RECENT):  # kept lately: at every round, what a failover may lose
        assert keeps.due(entries, r)[0] == [("a", ["1"], False), ("b", ["2"], False)]
        keep_all(keeps, entries, r)
    for r in range(RECENT, 10):
        assert keeps.due(entries, r) == ([], False)
    assert keys(keeps, entries, 10) == ["a", "b"]  # due: a third of the TTL


def test_a_new_entry_has_its_account_kept_at_once() -> None:
    keeps = AccountKeeps(every=10)
    entries = {"a": ["1"], "b": ["2"]}
    for r in range(RECENT + 1):
        keep_all(keeps, entries, r)
    assert keeps.due(entries, RECENT + 1)[0] == []
    entries["b"].append("3")
    assert keeps.due(entries, RECENT + 1)[0] == [("b", ["3"], False)]  # the new one alone


def test_a_loss_or_an_entry_written_back_keeps_every_account_next() -> None:
    keeps = AccountKeeps(every=10)
    entries = {"a": ["1"], "b": ["2"]}
    for r in range(RECENT + 1):
        keep_all(keeps, entries, r)
    keeps.lost()
    assert keeps.wants_all() and keys(keeps, entries, 5) == ["a", "b"]
    keep_all(keeps, entries, 5)
    assert not keeps.wants_all()
    entries["b"].append("3")  # new: kept at once, and found gone from Redis
    assert keeps.due(entries, 6) == ([("b", ["3"], False)], False)
    keeps.kept("b", ["3"], 6, False, restored=True)
    keeps.done(False, answered=True)
    assert keeps.wants_all()  # written back: other accounts may have lost theirs too
    due, everyone = keeps.due(entries, 7)
    for key, ids, whole in due:
        keeps.kept(key, ids, 7, whole, restored=True)  # a full round writes all back
    keeps.done(everyone, answered=True)
    assert not keeps.wants_all()
    assert keeps.due(entries, 7 + RECENT)[0] == []


def test_a_round_not_answered_in_full_keeps_every_account_again() -> None:
    keeps = AccountKeeps(every=10)
    entries = {"a": ["1"]}
    _keys, everyone = keeps.due(entries, 0)
    keeps.done(everyone, answered=False)
    assert keeps.wants_all()


def test_kept_three_times_within_the_ttl() -> None:
    assert AccountKeeps.of(30_000, 1.0).every == 10
    assert AccountKeeps.of(2_000, 1.0).every == 1


def test_entries_outlive_the_leases_kept_meanwhile() -> None:
    """Not due, an account's entries are not kept while the sweeps keep its leases (up to a
    third of the TTL, and a keep's time on its way): a keep makes them live that much more."""
    assert AccountKeeps.of(30_000, 1.0, 2_000).lag_ms == 12_000
    assert AccountKeeps.of(2_000, 1.0, 2_000).lag_ms == 0  # kept at every sweep
    assert AccountKeeps(1).lag_ms == 0  # a Cluster's


def test_an_account_is_due_a_third_of_the_ttl_after_its_last_keep_however_late_the_rounds() -> None:
    """Rounds run late (a slow Redis, a busy loop): `every` of them may outlast the TTL."""
    keeps = AccountKeeps.of(30_000, 1.0)
    entries = {"a": ["1"]}
    due, everyone = keeps.due(entries, 0, 0.0)
    for key, ids, whole in due:
        keeps.kept(key, ids, 0, whole, restored=False, at=0.0)
    keeps.done(everyone, answered=True)
    assert keys(keeps, entries, RECENT) == []
    assert keeps.due(entries, RECENT, 9.9)[0] == []
    assert keeps.due(entries, RECENT, 10.0)[0] == [("a", ["1"], True)]  # 4 rounds, 10 s


def test_a_heartbeat_that_misses_the_last_mark_keeps_every_account_next() -> None:
    keeps = AccountKeeps(every=10)
    entries = {"a": ["1"], "b": ["2"]}
    keep_all(keeps, entries, 0)
    keeps.beat("1", None)  # the first: nothing to find yet
    assert not keeps.wants_all()
    keeps.beat("2", "1")
    assert not keeps.wants_all()
    keeps.beat("3", "1")  # the mark of "2" is gone: Redis lost writes, keeps perhaps
    assert keeps.wants_all()
    keep_all(keeps, entries, 1)
    keeps.beat("4", "3")
    assert not keeps.wants_all()
    keeps.lost()  # a round not answered: its mark not known, not looked for
    keep_all(keeps, entries, 2)
    keeps.beat("6", "5")
    assert not keeps.wants_all()
