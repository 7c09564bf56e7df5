"""A zoo of small real models with BatchNorm, built from code with random weights: nothing is downloaded.

``ZOO[name] = (library, build)``; ``build()`` returns ``(model, example_inputs)``, the inputs as a tuple of
forward's arguments. Each library (timm, torchvision, segmentation_models_pytorch, monai, transformers) is
imported inside its builders only, so importing this module needs torch alone. Chosen from a survey of 111
candidates (see the README's real-world table): the BatchNorm forms and graph shapes people train.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

Builder = Callable[[], Tuple[nn.Module, Tuple[torch.Tensor, ...]]]
IMAGE = (1, 3, 64, 64)
VOLUME = (1, 1, 32, 32, 32)


def _x(shape: Tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _built(make: Callable[[], nn.Module], *shapes: Tuple[int, ...]) -> Builder:
    def build() -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
        torch.manual_seed(0)
        return make(), tuple(_x(s, i) for i, s in enumerate(shapes or (IMAGE,)))

    return build


def _timm(name: str, wrap: str = "", **kwargs: Any) -> Builder:
    def make() -> nn.Module:
        import timm
        import timm.layers

        model = timm.create_model(name, pretrained=False, **kwargs)
        return getattr(timm.layers, wrap)(model) if wrap else model

    return _built(make)


def _smp(arch: str, encoder: str) -> Builder:
    def make() -> nn.Module:
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)(encoder_name=encoder, encoder_weights=None, classes=2)

    return _built(make)


def _monai(cls: str, shape: Tuple[int, ...], **kwargs: Any) -> Builder:
    def make() -> nn.Module:
        import monai.networks.nets as nets

        return getattr(nets, cls)(**kwargs)

    return _built(make, shape)


def _hf(model_cls: str, config_cls: str, **kwargs: Any) -> Builder:
    def make() -> nn.Module:
        import transformers

        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))

    return _built(make)


def _tv(path: str, *shapes: Tuple[int, ...], **kwargs: Any) -> Builder:
    def make() -> nn.Module:
        import importlib

        module, _, fn = path.rpartition(".")
        return getattr(importlib.import_module(module), fn)(**kwargs)

    return _built(make, *shapes)


class RaftFewUpdates(nn.Module):
    """RAFT with two flow updates (the default twelve take ~10 s on one CPU thread)."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models.optical_flow import raft_large

        self.raft = raft_large(weights=None)

    def forward(self, image1: torch.Tensor, image2: torch.Tensor) -> Any:
        return self.raft(image1, image2, num_flow_updates=2)


def _rtdetr_frozen() -> nn.Module:
    """RT-DETR's ResNet backbone with its BatchNorms frozen as RTDetrConvEncoder does (RTDetrFrozenBatchNorm2d)."""
    import transformers
    from transformers.models.rt_detr.modeling_rt_detr import replace_batch_norm

    model = transformers.RTDetrResNetBackbone(transformers.RTDetrResNetConfig(
        embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], layer_type="basic",
        out_features=["stage2", "stage3", "stage4"]))
    with torch.no_grad():  # with grad on, the frozen buffers would be non-leaf tensors that cannot be copied
        replace_batch_norm(model)
    return model


ZOO: Dict[str, Tuple[str, Builder]] = {
    # timm with BatchNormAct2d and friends (21)
    **{f"timm/{n}": ("timm", _timm(n)) for n in (
        "efficientnet_b0", "tf_efficientnet_b0", "mobilenetv3_small_050", "mobilenetv4_conv_small", "mixnet_s",
        "lcnet_050", "regnety_002", "cspresnet50", "rexnet_100", "dpn48b", "densenet121", "resnetv2_18",
        "gernet_s", "ese_vovnet19b_slim_dw", "repvgg_a0", "mobileone_s0", "fastvit_t8", "lcnetv2_small",
        "test_byobnet")},
    "timm/efficientnet_b0+freeze_batch_norm_2d": ("timm", _timm("efficientnet_b0", wrap="freeze_batch_norm_2d")),
    "timm/mobilenetv3_small_050+convert_sync_batchnorm": (
        "timm", _timm("mobilenetv3_small_050", wrap="convert_sync_batchnorm")),
    # timm, other BatchNorm patterns (5)
    "timm/test_nfnet": ("timm", _timm("test_nfnet")),  # F.batch_norm on weights (batch statistics): not a BatchNorm
    "timm/levit_128s": ("timm", _timm("levit_128s", img_size=64)),  # Linear -> flatten -> BatchNorm1d -> reshape
    "timm/efficientvit_m0": ("timm", _timm("efficientvit_m0")),
    "timm/hrnet_w18_small": ("timm", _timm("hrnet_w18_small")),
    "timm/repvit_m0_9": ("timm", _timm("repvit_m0_9")),
    # torchvision detection, segmentation, video, optical flow (6)
    "torchvision/resnet_fpn_backbone(resnet18)": (
        "torchvision", _tv("torchvision.models.detection.backbone_utils.resnet_fpn_backbone",
                           backbone_name="resnet18", weights=None)),
    "torchvision/mobilenet_backbone(mobilenet_v3_large,fpn)": (
        "torchvision", _tv("torchvision.models.detection.backbone_utils.mobilenet_backbone",
                           backbone_name="mobilenet_v3_large", weights=None, fpn=True)),
    "torchvision/lraspp_mobilenet_v3_large": (
        "torchvision", _tv("torchvision.models.segmentation.lraspp_mobilenet_v3_large", weights=None,
                           weights_backbone=None)),
    "torchvision/deeplabv3_mobilenet_v3_large": (
        "torchvision", _tv("torchvision.models.segmentation.deeplabv3_mobilenet_v3_large", weights=None,
                           weights_backbone=None, aux_loss=True)),
    "torchvision/r3d_18": ("torchvision", _tv("torchvision.models.video.r3d_18", (1, 3, 4, 32, 32), weights=None)),
    "torchvision/raft_large": ("torchvision", _built(RaftFewUpdates, (1, 3, 128, 128), (1, 3, 128, 128))),
    # segmentation_models_pytorch (5)
    "smp/Unet(resnet18)": ("smp", _smp("Unet", "resnet18")),
    "smp/FPN(mobilenet_v2)": ("smp", _smp("FPN", "mobilenet_v2")),
    "smp/Unet(tu-mobilenetv3_small_100)": ("smp", _smp("Unet", "tu-mobilenetv3_small_100")),
    "smp/Linknet(resnet18)": ("smp", _smp("Linknet", "resnet18")),
    "smp/Unet(mobileone_s0)": ("smp", _smp("Unet", "mobileone_s0")),
    # MONAI (8)
    "monai/BasicUNet-2d": ("monai", _monai("BasicUNet", IMAGE, spatial_dims=2, in_channels=3, out_channels=2,
                                           features=(8, 8, 16, 32, 64, 8), norm="batch")),
    "monai/FlexibleUNet-effb0": ("monai", _monai("FlexibleUNet", IMAGE, in_channels=3, out_channels=2,
                                                 backbone="efficientnet-b0", pretrained=False,
                                                 decoder_channels=(64, 32, 16, 8, 8))),
    "monai/UNet-3d": ("monai", _monai("UNet", VOLUME, spatial_dims=3, in_channels=1, out_channels=2,
                                      channels=(8, 16, 32, 64), strides=(2, 2, 2), num_res_units=2, norm="batch")),
    "monai/DenseNet121-3d-tiny": ("monai", _monai("DenseNet121", VOLUME, spatial_dims=3, in_channels=1,
                                                  out_channels=2, init_features=16, growth_rate=8,
                                                  block_config=(2, 2, 2, 2))),
    "monai/SegResNet-3d": ("monai", _monai("SegResNet", VOLUME, spatial_dims=3, init_filters=8, in_channels=1,
                                           out_channels=2, norm="batch")),
    "monai/DynUNet-3d": ("monai", _monai("DynUNet", (1, 1, 16, 16, 16), spatial_dims=3, in_channels=1,
                                         out_channels=2, kernel_size=[3, 3, 3], strides=[1, 2, 2],
                                         upsample_kernel_size=[2, 2], filters=[8, 16, 32], norm_name="batch",
                                         res_block=True)),
    "monai/AttentionUnet-2d": ("monai", _monai("AttentionUnet", IMAGE, spatial_dims=2, in_channels=3,
                                               out_channels=2, channels=(8, 16, 32, 64), strides=(2, 2, 2))),
    "monai/HighResNet-2d": ("monai", _monai("HighResNet", IMAGE, spatial_dims=2, in_channels=3, out_channels=2)),
    # Hugging Face transformers (6), built from small configs
    "transformers/ResNetForImageClassification": (
        "transformers", _hf("ResNetForImageClassification", "ResNetConfig", embedding_size=16,
                            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], layer_type="basic", num_labels=10)),
    "transformers/MobileNetV2ForImageClassification": (
        "transformers", _hf("MobileNetV2ForImageClassification", "MobileNetV2Config", depth_multiplier=0.35,
                            image_size=64, num_labels=10)),
    "transformers/EfficientNetForImageClassification": (
        "transformers", _hf("EfficientNetForImageClassification", "EfficientNetConfig", image_size=64,
                            width_coefficient=0.5, depth_coefficient=0.5, hidden_dim=640, num_labels=10)),
    "transformers/LevitForImageClassification": (
        "transformers", _hf("LevitForImageClassification", "LevitConfig", image_size=64, patch_size=16,
                            hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
                            key_dim=[8, 8, 8], attention_ratio=[2, 2, 2], mlp_ratio=[2, 2, 2],
                            down_ops=[["Subsample", 8, 1, 4, 2, 2], ["Subsample", 8, 2, 4, 2, 2]], num_labels=10)),
    "transformers/SwiftFormerForImageClassification": (
        "transformers", _hf("SwiftFormerForImageClassification", "SwiftFormerConfig", depths=[1, 1, 1, 1],
                            embed_dims=[16, 32, 48, 64], num_labels=10)),
    "transformers/RTDetrResNetBackbone+replace_batch_norm": ("transformers", _built(_rtdetr_frozen)),
}
