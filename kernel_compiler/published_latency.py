"""Published V100 inference latencies of zoo models: what the V100 preset is calibrated against.

Each figure is one model's batch-1 fp32 PyTorch latency on a V100 as its source reports it, with the
conditions that matter (GPU variant, framework version, what the timing includes). docs/device.md
("Kernel cost model") cites them; benchmarks/bench_device.py prints the modelled latency beside each.
Zoo models absent here have no published figure that we found (see `UNPUBLISHED`).
"""

from __future__ import annotations

from dataclasses import dataclass

_DLINFBENCH = "https://github.com/nicklhy/DLInfBench"


@dataclass(frozen=True)
class PublishedLatency:
    model: str  # zoo name
    ms: float
    gpu: str
    framework: str
    precision: str
    batch: int
    source: str  # title and URL
    conditions: str  # what differs from the zoo model, or what the timing includes


PUBLISHED: tuple[PublishedLatency, ...] = (
    PublishedLatency(
        "alexnet",
        1000 / 475.457908,
        "Tesla V100-PCIE-16GB",
        "PyTorch 0.4.0, CUDA 9.1, cuDNN 7.1.3",
        "fp32",
        1,
        f"DLInfBench, results/tesla_v100/pytorch_alexnet_float32_1.txt (475.46 img/s): {_DLINFBENCH}",
        "torchvision AlexNet at 227x227 (the zoo: 224x224); per-image time of a loop that also copies "
        "each input to the GPU",
    ),
    PublishedLatency(
        "vgg16",
        1000 / 74.631699,
        "Tesla V100-PCIE-16GB",
        "PyTorch 0.4.0, CUDA 9.1, cuDNN 7.1.3",
        "fp32",
        1,
        f"DLInfBench, results/tesla_v100/pytorch_vgg16_float32_1.txt (74.63 img/s): {_DLINFBENCH}",
        "torchvision VGG-16 at 224x224; per-image time including the input copy",
    ),
    PublishedLatency(
        "resnet50",
        1000 / 121.936864,
        "Tesla V100-PCIE-16GB",
        "PyTorch 0.4.0, CUDA 9.1, cuDNN 7.1.3",
        "fp32",
        1,
        f"DLInfBench, results/tesla_v100/pytorch_resnet50_float32_1.txt (121.94 img/s): {_DLINFBENCH}",
        "torchvision ResNet-50 at 224x224; per-image time including the input copy",
    ),
    PublishedLatency(
        "resnet50",
        10.37,
        "V100-SXM2-16GB (DGX-1)",
        "PyTorch NGC container 21.03",
        "fp32",
        1,
        "NVIDIA Deep Learning Examples, ResNet50 v1.5 for PyTorch, 'Inference performance: NVIDIA DGX-1 "
        "(1x V100 16GB)', FP32 inference latency table: https://github.com/NVIDIA/DeepLearningExamples/"
        "blob/master/PyTorch/Classification/ConvNets/resnet50v1.5/README.md",
        "ResNet-50 v1.5 (stride 2 in the 3x3 convolutions, as torchvision's); average latency",
    ),
    PublishedLatency(
        "resnet50",
        10.42,
        "Tesla V100-SXM2",
        "PyTorch (torchvision model; version not stated)",
        "fp32",
        1,
        "pytorch_experiments, torchvision_exp/README.md, Inference table, row 'FP32, NCHW': "
        "https://github.com/sandeepkumar-skb/pytorch_experiments",
        "iteration time of torchvision ResNet-50",
    ),
)

#: Zoo models with no published V100 batch-1 fp32 PyTorch latency that we found: modelled only.
UNPUBLISHED: dict[str, str] = {
    "resnet18": "no V100 batch-1 fp32 PyTorch figure found (DLInfBench and NVIDIA's examples skip it)",
    "mobilenet_v3_small": "no V100 batch-1 fp32 PyTorch figure found",
    "ssdlite320_mobilenet_v3": "no V100 batch-1 figure for the tensor part alone (timings include NMS)",
    "espcn": "written for StreamBox (its own layer sizes): nothing to cite",
    "text_encoder": "written for StreamBox (its own layer sizes): nothing to cite",
}
