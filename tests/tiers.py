"""Parametrizations split between the default tier and the slow one (``CUBE_SLOW=1``).

A case goes to the slow tier only when a default-tier test covers what it checks.
"""
import pytest


def tiered(cases, ids, slow):
    """``pytest.param`` of each case with its id, marked ``slow`` where its id is in ``slow``.

    An id given to several cases gets their index among them appended (``x0``, ``x1``; ``x2_0``
    after a digit), as pytest does with the ids it makes.
    """
    ids = list(ids)
    count, unique = {}, []
    for i in ids:
        if ids.count(i) > 1:
            count[i] = count.get(i, -1) + 1
            unique.append(f"{i}{'_' if i[-1:].isdigit() else ''}{count[i]}")
        else:
            unique.append(i)
    unknown = set(slow) - set(unique)
    assert not unknown, f"slow ids that name no case: {sorted(unknown)}"
    return [pytest.param(*c, id=i, marks=[pytest.mark.slow] if i in slow else []) for c, i in zip(cases, unique)]
