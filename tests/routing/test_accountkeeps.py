"""Which accounts a sweep keeps (routing/admission/accountkeeps.py): every account at first
and after a loss, then only those with entries kept lately and those due."""

from __future__ import annotations

from routing.admission.accountkeeps import RECENT, AccountKeeps


def keep_all(keeps: AccountKeeps, entries: dict[str, list[str]], round_: int) -> None:
    keys, everyone = keeps.due(entries, round_)
    for key in keys:
        keeps.kept(key, entries[key], round_, restored=False)
    keeps.done(everyone, answered=True)


def test_the_first_round_keeps_every_account_then_only_recent_entries_and_due_accounts() -> None:
    keeps = AccountKeeps(every=10)
    entries = {"a": ["1"], "b": ["2"]}
    assert keeps.due(entries, 0) == (["a", "b"], True)
    keep_all(keeps, entries, 0)
    for r in range(1, RECENT):  # kept lately: at every round, what a failover may lose
        assert keeps.due(entries, r)[0] == ["a", "b"]
        keep_all(keeps, entries, r)
    last = RECENT - 1
    for r in range(RECENT, last + 10):
        assert keeps.due(entries, r) == ([], False)
    assert keeps.due(entries, last + 10)[0] == ["a", "b"]  # due: a third of the TTL


def test_a_new_entry_has_its_account_kept_at_once() -> None:
    keeps = AccountKeeps(every=10)
    entries = {"a": ["1"], "b": ["2"]}
    for r in range(RECENT + 1):
        keep_all(keeps, entries, r)
    assert keeps.due(entries, RECENT + 1)[0] == []
    entries["b"].append("3")
    assert keeps.due(entries, RECENT + 1)[0] == ["b"]


def test_a_loss_or_an_entry_written_back_keeps_every_account_next() -> None:
    keeps = AccountKeeps(every=10)
    entries = {"a": ["1"], "b": ["2"]}
    for r in range(RECENT + 1):
        keep_all(keeps, entries, r)
    keeps.lost()
    assert keeps.wants_all() and keeps.due(entries, 5) == (["a", "b"], True)
    keep_all(keeps, entries, 5)
    assert not keeps.wants_all()
    entries["b"].append("3")  # new: kept at once, and found gone from Redis (not "2")
    assert keeps.due(entries, 6) == (["b"], False)
    keeps.kept("b", entries["b"], 6, restored=True)
    keeps.done(False, answered=True)
    assert keeps.wants_all()  # written back: other accounts may have lost theirs too
    keys, everyone = keeps.due(entries, 7)
    for key in keys:
        keeps.kept(key, entries[key], 7, restored=True)  # a full round writes all back
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
