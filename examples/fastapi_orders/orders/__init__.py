"""An order service: the API places orders, a skiplock worker fulfils them."""
