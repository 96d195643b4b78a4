"""An image reward for `omni init flow_grpo`'s pipeline, with verl's signature (VeRL-Omni passes the image
as `solution_image`, omni as `solution_str`: take either).

The image is an RGB array (height x width x 3, uint8) or a PIL image; `ground_truth` is the row's
`reward_model.ground_truth` (OCR prompts: the text the image should show). Return a float, or a dict with
"score".
"""

import numpy as np
from PIL import Image


def compute_score(data_source, solution_str=None, ground_truth=None, extra_info=None, *, solution_image=None,
                  **kwargs):
    """Brightness: the mean pixel value in [0, 1]. Replace it with what you want the model to draw."""
    image = solution_image if solution_image is not None else solution_str
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image, dtype=np.float32)
    return float(pixels.mean() / 255.0)
