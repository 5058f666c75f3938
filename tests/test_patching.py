"""megatron_p2p._patching.Swap, the mechanism of patch_megatron() and patch_pipelining(), on
stand-in modules of a package that exists only here."""
import sys
import types

import pytest

from megatron_p2p._patching import Swap, package_modules

PKG = "_mp_fake_pkg"


@pytest.fixture
def modules():
    made = {}

    def add(name, **attrs):
        mod = types.ModuleType(name)
        vars(mod).update(attrs)
        sys.modules[name] = made[name] = mod
        return mod

    yield add
    for name in made:
        sys.modules.pop(name, None)


def test_swaps_by_identity_in_the_package_only_and_restores_it(modules):
    orig, ours, other = object(), object(), object()
    top = modules(PKG, a=orig, b=other)
    sub = modules(PKG + ".sub", a=orig, alias=orig)
    outside = modules(PKG + "_other", a=orig)
    swap = Swap(PKG, [(orig, ours)])
    swap.apply()
    assert swap.applied and top.a is ours and sub.a is ours and sub.alias is ours
    assert top.b is other and outside.a is orig
    assert swap.swapped == [(PKG, "a"), (PKG + ".sub", "a"), (PKG + ".sub", "alias")]
    later = modules(PKG + ".later", a=ours)  # imported while applied: bound ours
    swap.restore()
    assert not swap.applied and swap.swapped == []
    assert top.a is orig and sub.a is orig and sub.alias is orig and later.a is orig
    swap.restore()  # idempotent


def test_a_second_apply_is_refused(modules):
    orig, ours = object(), object()
    modules(PKG, a=orig)
    swap = Swap(PKG, [(orig, ours)])
    swap.apply()
    with pytest.raises(RuntimeError, match="already applied"):
        swap.apply()
    swap.restore()
    swap.apply()  # again after restore
    swap.restore()


def test_restores_in_reverse_order_and_leaves_a_binding_someone_else_changed(modules):
    orig, ours, theirs = object(), object(), object()
    mod = modules(PKG, a=orig, b=orig)
    swap = Swap(PKG, [(orig, ours)])
    swap.apply()
    mod.b = theirs
    swap.restore()
    assert mod.a is orig and mod.b is theirs


def test_apply_is_all_or_nothing(modules):
    orig, ours = object(), object()

    class Refusing(types.ModuleType):
        def __setattr__(self, name, value):
            raise AttributeError(f"read-only {name}")

    first = modules(PKG, a=orig)
    refusing = Refusing(PKG + ".z")
    vars(refusing)["a"] = orig
    sys.modules[refusing.__name__] = refusing
    try:
        swap = Swap(PKG, [(orig, ours)])
        with pytest.raises(AttributeError, match="read-only"):
            swap.apply()
        assert first.a is orig and refusing.a is orig
        assert not swap.applied and swap.swapped == []
    finally:
        sys.modules.pop(refusing.__name__)
    assert [n for n, _ in package_modules(PKG)] == [PKG]
