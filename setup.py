from setuptools import find_packages, setup

setup(
    name="cube-compiler",
    version="0.1.0",
    description="Compile single-device PyTorch training into distributed training from a policy.",
    packages=find_packages(include=["cube", "cube.*"]),   # the policies ship as cube.policies
    package_data={"cube.sim.hardware": ["*.json"]},   # the shipped hardware profiles
    python_requires=">=3.10",
    install_requires=["torch>=2.4,<=2.14.1", "numpy", "safetensors", "rich"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "transformers", "viztracer", "onnx", "onnxruntime", "onnxscript",
                 "mkdocs-material", "mkdocstrings[python]"],
        # the documentation site: mkdocs build --strict (mkdocs.yml)
        "docs": ["mkdocs-material", "mkdocstrings[python]"],
        # cube.onnx: import ONNX models (onnx), export them from torch (onnxscript), run them (onnxruntime)
        "onnx": ["onnx>=1.15", "onnxruntime", "onnxscript"],
    },
)
