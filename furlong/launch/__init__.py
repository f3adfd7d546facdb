"""furlong.launch: process start-up of every command (one process, N local workers, torchrun) and signals."""
