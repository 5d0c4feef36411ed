from kkdeploy.cli import main


def test_shapes_command(capsys):
    assert main(["shapes"]) == 0
    out = capsys.readouterr().out
    assert "10000" in out and "100000" in out


def test_check_passes_and_exit_code(capsys):
    args = ["check", "--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2",
            "--ffn-dim", "16", "--layers", "2", "--trials", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("PASS failed 0/256") == 2 and out.strip().endswith("PASS")
    assert main(args + ["--padding-ratio", "0.5", "--dtype", "float16"]) == 0


def test_check_bad_input_is_one_line(capsys):
    assert main(["check", "--shape", "0"]) == 2
    err = capsys.readouterr().err
    assert "unknown shape id 0" in err and "Traceback" not in err
    assert main(["check", "--batch-size", "2"]) == 2
    assert "custom shape needs" in capsys.readouterr().err
    assert main(["check", "--shape", "3", "--heads", "3"]) == 2
    assert main(["check", "--batch-size", "2", "--seq-len", "8", "--d-model", "10", "--heads", "3",
                 "--ffn-dim", "4", "--layers", "1"]) == 2
    assert "not divisible" in capsys.readouterr().err
