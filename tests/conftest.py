import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

torch.set_num_threads(1)
