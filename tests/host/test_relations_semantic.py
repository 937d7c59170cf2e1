"""Relations and row-invariance claims hold on the host, on inputs drawn by Hypothesis."""

import shutil

from hypothesis import given
from hypothesis import strategies as st

from metrale.cli import main
from metrale.lkb.check import check_relation, check_row_invariance
from metrale.lkb.presentation import FAMILIES_FILE, FUSIONS_FILE, Presentation, default_kernels_dir

P = Presentation.load()


@given(st.sampled_from(P.relations), st.integers(0, 2**31 - 1))
def test_every_relation_holds_on_random_inputs(rel, seed):
    findings = check_relation(P, rel, seed)
    assert findings, f"{rel.name} has no compiled rhs point to check"
    assert all(f.ok for f in findings), [str(f) for f in findings if not f.ok]


@given(st.sampled_from(P.generators), st.integers(0, 2**31 - 1))
def test_row_invariance_claims_hold(fam, seed):
    findings = check_row_invariance(P, fam, seed)
    assert all(f.ok for f in findings), [str(f) for f in findings if not f.ok]
    assert len(findings) == (len(fam.points) if fam.row_invariant else 0)


def test_met_check_passes_on_the_shipped_presentation(capsys):
    assert main(["check", "--hardware", "host", "--seeds", "1"]) == 0
    assert " 0 failed" in capsys.readouterr().out


def test_met_check_catches_a_relation_that_lies_about_its_reduction_order(tmp_path, capsys):
    for name in (FAMILIES_FILE, FUSIONS_FILE):
        shutil.copy(default_kernels_dir() / name, tmp_path / name)
    with open(tmp_path / FUSIONS_FILE, "a") as f:
        f.write('\n[relation.lying_splitk]\n'
                'doc = "claims bit-identity across a different reduction order"\n'
                'lhs = "y = linear[across=sequential](x, w)"\n'
                'rhs = "y = linear[across=pairwise](x, w)"\n'
                'numerics = "bit_identical"\n')
    assert main(["check", "--kernels", str(tmp_path), "--seeds", "2", "--only", "lying_splitk"]) == 1
    out = capsys.readouterr().out
    assert "FAIL lying_splitk" in out and "claimed bit-identical" in out
    assert " failed (1 relations, 0 families, 2 seeds" in out, out


def test_a_bound_too_tight_is_caught(tmp_path, capsys):
    for name in (FAMILIES_FILE, FUSIONS_FILE):
        shutil.copy(default_kernels_dir() / name, tmp_path / name)
    text = (tmp_path / FUSIONS_FILE).read_text().replace(
        'bound = { rel = "3 * eps_act", abs = "2 * (1 + eps_act) * gamma(k + 1, eps_f32)" }',
        'bound = { rel = "0", abs = "0" }')
    assert 'rel = "0", abs = "0"' in text
    (tmp_path / FUSIONS_FILE).write_text(text)
    tightened = ["splitk_pairwise", "chain_linear", "chain_qkv"]  # the relations of that bound
    assert main(["check", "--kernels", str(tmp_path), "--seeds", "2",
                 "--only", ",".join(tightened)]) == 1
    out = capsys.readouterr().out
    assert "outside its bound" in out and "(3 relations, 0 families" in out, out


def test_met_check_only_checks_what_it_names_and_refuses_a_name_it_lacks(capsys):
    assert main(["check", "--seeds", "1", "--only", "splitk_pairwise,linear", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "(1 relations, 1 families, 1 seeds" in out, out
    assert {line.split()[1] for line in out.splitlines()[:-1]} == {"splitk_pairwise", "linear"}
    assert main(["check", "--only", "splitk_pairwize"]) == 3
    err = capsys.readouterr().err
    assert "--only" in err and "splitk_pairwise" in err, err
