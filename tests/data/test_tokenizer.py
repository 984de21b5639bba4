import numpy as np
import pytest
import torch

from protein_performer.data.tokenizer import ESM2_TOKENS, Alphabet


def test_vocabulary_matches_esm2_order():
    alphabet = Alphabet()
    assert len(alphabet) == 33
    assert ESM2_TOKENS[:4] == ("<cls>", "<pad>", "<eos>", "<unk>")
    assert "".join(ESM2_TOKENS[4:24]) == "LAGVSERTIDPKQNFYMHWC"
    assert ESM2_TOKENS[24:31] == tuple("XBUZO.-")
    assert ESM2_TOKENS[31:] == ("<null_1>", "<mask>")
    assert (alphabet.cls_idx, alphabet.pad_idx, alphabet.eos_idx, alphabet.unk_idx) == (0, 1, 2, 3)
    assert alphabet.mask_idx == 32


def test_encode_decode_roundtrip():
    alphabet = Alphabet()
    ids = alphabet.encode("MKTAYX")
    np.testing.assert_array_equal(ids, [20, 15, 11, 5, 19, 24])
    assert alphabet.decode(ids) == "MKTAYX"
    assert alphabet.decode([0, 20, 32, 2], strip_special=False) == "<cls>M<mask><eos>"


@pytest.mark.parametrize("bad, pos", [("MKJA", 3), ("MK1A", 3), ("MK A", 3), ("mk", 1)])
def test_encode_rejects_invalid_letters_with_position(bad, pos):
    with pytest.raises(ValueError, match=f"position {pos}"):
        Alphabet().encode(bad)


def test_encode_batch_exact_ids():
    tokens = Alphabet().encode_batch(["MKT", "GL"])
    expected = torch.tensor([[0, 20, 15, 11, 2], [0, 6, 4, 2, 1]])
    assert torch.equal(tokens, expected)
    assert tokens.dtype == torch.long
