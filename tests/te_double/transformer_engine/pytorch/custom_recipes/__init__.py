"""Test double of `transformer_engine.pytorch.custom_recipes`: its submodules follow the version.

TE moved the reference NVFP4 factory twice, so which submodules exist depends on the version the
double stands in for (`transformer_engine._double.VERSION`, from the dist-info first on sys.path):

    TE < 2.16      custom_recipes.quantization_nvfp4.nvfp4_ref_rht_2d_quantizer_factory(role: str)
                   and custom_recipes.utils (v2.10-v2.15; the double uses this layout for any
                   version below 2.16, though TE 2.9 had these under pytorch.experimental)
    TE 2.16-2.18   custom_recipes.quantization_ref_nvfp4.nvfp4_ref_rht_2d_quantizer_factory(role:
                   QuantizerRole) and custom_recipes.utils (v2.16, v2.18)
    TE >= 2.19     custom_recipes.reference_nvfp4.nvfp4_ref_rht_2d_factory(role: QuantizerRole) and
                   custom_recipes.reference_utils (main at 2.20.0.dev0, d0067d0)

Each layout is a folder this package's `__path__` points at, so a module of another version is
absent as in a real wheel: `import ...quantization_nvfp4` raises ModuleNotFoundError on 2.16 and
`importlib.util.find_spec` returns None.
"""

import os

from transformer_engine._double import version_tuple

_VERSION = version_tuple()
_LAYOUT = "_te_2_14" if _VERSION < (2, 16) else "_te_2_16" if _VERSION < (2, 19) else "_te_2_19"
__path__ = [os.path.join(os.path.dirname(os.path.abspath(__file__)), _LAYOUT)]
