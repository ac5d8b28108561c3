"""gres.conf from the hardware: inventories and the generated file."""
