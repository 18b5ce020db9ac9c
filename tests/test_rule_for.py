"""An optimizer's update rule is learned in one way: ``rule_for(group)``.

A class names its default rule in the attribute ``rule``; a subclass may answer per group instead
(Muon's matrices beside its AdamW groups, RMSprop with momentum). Code that read ``cls.rule`` directly
would miss those answers: the memory estimate once counted RMSprop with momentum as one state. So no
module of ds_q8 reads a ``.rule`` attribute outside a method named ``rule_for``, except an object's own
``self.rule`` where its class sets it in ``__init__`` (a step plan holding the rule it was given).
The source is read with ``ast``; nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import List

PACKAGE = Path(__file__).resolve().parents[1] / "ds_q8"


def _sets_self_rule(cls: ast.ClassDef) -> bool:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and sub.attr == "rule" and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    return True
    return False


def rule_reads(source: str, name: str = "<source>") -> List[str]:
    """``name:line: expression`` for every read of a ``.rule`` attribute outside ``rule_for``."""
    found = []

    def visit(node, in_rule_for: bool, own_rule: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, False, _sets_self_rule(child))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, in_rule_for or child.name == "rule_for", own_rule)
            else:
                if (isinstance(child, ast.Attribute) and child.attr == "rule" and isinstance(child.ctx, ast.Load)
                        and not in_rule_for
                        and not (own_rule and isinstance(child.value, ast.Name) and child.value.id == "self")):
                    found.append(f"{name}:{child.lineno}: {ast.unparse(child)}")
                visit(child, in_rule_for, own_rule)

    visit(ast.parse(source, name), False, False)
    return found


def test_only_rule_for_reads_a_class_level_rule():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += rule_reads(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "ask rule_for(group) (or rule_when_built) instead of reading .rule:\n" + "\n".join(found)


def test_the_check_finds_planted_reads():
    source = '''
class Opt:
    rule = None

    def rule_for(self, group):
        return self.rule

    def names(self):
        return type(self).rule.state_names

    @classmethod
    def export(cls):
        return cls.rule


class Plan:
    def __init__(self, rule):
        self.rule = rule

    def run(self):
        return self.rule.num_states


def count(name):
    return OPTIMIZERS[name].rule.num_states
'''
    found = rule_reads(source)
    assert [f.split(": ", 1)[1] for f in found] == ["type(self).rule", "cls.rule", "OPTIMIZERS[name].rule"], found
