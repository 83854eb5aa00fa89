"""The Kafka ACLs per role that modules/kafka-acls renders (a real `terraform apply`, no provider):
the names they grant are the ones the code uses, each role holds what its clients do and no more,
and docs/security.md states the same table."""

from __future__ import annotations

import re
from typing import Any

import pytest
from tf_support import REPO, TF_ROOT, Terraform

from fleetrl.broker import STREAMS, rollout_group, topic_name, trainer_group, trainer_handover_group

RUN = "acl-run"
PRINCIPALS = {"trainer": "User:fleetrl-trainer", "rollout": "User:fleetrl-node", "operator": "User:fleetrl-ops"}
Binding = tuple[str, str, str, str]  # role, resource type, pattern type, resource name


@pytest.fixture(scope="module")
def rendered(terraform: Terraform, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("acls")
    principals = ", ".join(f'{k} = "{v}"' for k, v in PRINCIPALS.items())
    (root / "main.tf").write_text(f'''
module "acls" {{
  source     = "{TF_ROOT / "modules" / "kafka-acls"}"
  run        = "{RUN}"
  bootstrap  = "b-1.example:9096"
  principals = {{ {principals} }}
}}
output "acls" {{ value = module.acls.acls }}
output "commands" {{ value = module.acls.commands }}
''')
    return terraform.apply_outputs(root)


def _grants(acls: list[dict[str, Any]]) -> dict[Binding, set[str]]:
    out: dict[Binding, set[str]] = {}
    for a in acls:
        assert a["permission"] == "Allow" and a["host"] == "*" and a["principal"] == PRINCIPALS[a["role"]], a
        key = (a["role"], a["resource_type"].lower(), a["pattern_type"].lower(), a["resource_name"])
        out.setdefault(key, set()).add(a["operation"])
    return out


def _allowed(grants: dict[Binding, set[str]], role: str, kind: str, name: str) -> set[str]:
    """What `role` may do on the topic or group `name`: literal grants on it, prefixed ones covering it."""
    ops: set[str] = set()
    for (r, k, pattern, resource), granted in grants.items():
        if r == role and k == kind and (resource == name if pattern == "literal" else name.startswith(resource)):
            ops |= granted
    return ops


def test_granted_names_are_the_codes_topics_and_groups(rendered: dict[str, Any]) -> None:
    names = {(a["resource_type"], a["pattern_type"], a["resource_name"]) for a in rendered["acls"]}
    topics = {topic_name(RUN, s) for s in STREAMS}
    for kind, pattern, name in names:
        if pattern == "PREFIXED":
            assert name == f"fleetrl.{RUN}." and all(t.startswith(name) for t in topics), name
        elif kind == "Topic":
            assert name in topics, name
        else:
            assert name in {rollout_group(RUN), trainer_group(RUN), trainer_handover_group(RUN)}, name


def test_each_role_holds_what_its_clients_do_and_no_more(rendered: dict[str, Any]) -> None:
    g = _grants(rendered["acls"])
    t = {s: topic_name(RUN, s) for s in STREAMS}
    # trainer: topics create, dispatch, collect in its group, dead-letter
    assert {"Create", "DescribeConfigs", "Describe"} <= _allowed(g, "trainer", "topic", t["prompts"])
    assert "Write" in _allowed(g, "trainer", "topic", t["prompts"])
    assert "Read" in _allowed(g, "trainer", "topic", t["trajectories"])
    assert "Write" in _allowed(g, "trainer", "topic", t["dead-letter"])
    assert _allowed(g, "trainer", "group", trainer_group(RUN)) == {"Read"}
    # trainer: a gone region's partials, read in the handover group and written to another region
    assert {"Read", "Write"} <= _allowed(g, "trainer", "topic", t["partials"])
    assert _allowed(g, "trainer", "group", trainer_handover_group(RUN)) == {"Read"}
    # rollout node: consume prompts/partials in its group, produce partials/trajectories/dead letters
    assert _allowed(g, "rollout", "topic", t["prompts"]) == {"Describe", "Read"}
    assert _allowed(g, "rollout", "topic", t["partials"]) == {"Describe", "Read", "Write"}
    assert _allowed(g, "rollout", "topic", t["trajectories"]) == {"Describe", "Write"}
    assert _allowed(g, "rollout", "topic", t["dead-letter"]) == {"Describe", "Write"}
    assert _allowed(g, "rollout", "group", rollout_group(RUN)) == {"Read"}
    assert _allowed(g, "rollout", "group", trainer_group(RUN)) == set()
    # operator tools: read everything, lag (describe groups), replay into the data topics
    assert all({"Read", "Describe"} <= _allowed(g, "operator", "topic", name) for name in t.values())
    assert {s for s, name in t.items() if "Write" in _allowed(g, "operator", "topic", name)} == {
        "prompts", "partials", "trajectories"}
    assert _allowed(g, "operator", "group", trainer_group(RUN)) == {"Describe"}
    # nobody deletes or alters; only the trainer and the operator create
    ops = {a["operation"] for a in rendered["acls"]}
    assert not ops & {"Delete", "Alter", "AlterConfigs", "All", "ClusterAction"}
    assert {a["role"] for a in rendered["acls"] if a["operation"] == "Create"} == {"trainer", "operator"}
    # another run's topics are out of reach
    assert all(not _allowed(g, role, "topic", topic_name("other", "prompts")) for role in PRINCIPALS)


def test_one_kafka_acls_command_per_binding_row(rendered: dict[str, Any]) -> None:
    rows = _grants(rendered["acls"])
    commands = rendered["commands"]
    assert len(commands) == len(rows)
    for (role, kind, pattern, name), ops in rows.items():
        want = [f"--allow-principal {PRINCIPALS[role]}", f"--{kind} {name} --resource-pattern-type {pattern}",
                "kafka-acls.sh --bootstrap-server b-1.example:9096 --command-config admin.properties --add"]
        matching = [c for c in commands if all(w in c for w in want)
                    and set(re.findall(r"--operation (\w+)", c)) == ops]
        assert len(matching) == 1, (role, kind, name, ops)


def test_docs_security_md_states_the_rendered_table(rendered: dict[str, Any]) -> None:
    text = (REPO / "docs" / "security.md").read_text()
    table = text.split("<!-- BEGIN kafka-acls -->\n", 1)[1].split("<!-- END kafka-acls -->", 1)[0]
    documented: dict[Binding, set[str]] = {}
    for line in table.splitlines()[2:]:
        role, kind, name, pattern, ops = (c.strip() for c in line.strip("|").split("|"))
        key = (role, kind, pattern, name.strip("`").replace("<run>", RUN))
        assert key not in documented, f"docs/security.md lists {key} twice"
        documented[key] = {o.strip() for o in ops.split(",")}
    assert documented == _grants(rendered["acls"])

